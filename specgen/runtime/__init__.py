"""How a model's forwards run: position-indexed KV caches (`kvcache`), fixed-shape steps
replayed as CUDA graphs (`compiled`), the lean CPU forward (`lean`), batch-exact attention
(`exact_attention`), int8 and pruned weights (`int8`, `pruned`, `quant`), and a loaded pair
in the formats it runs in (`pair`). Nothing here knows about drafting or acceptance.
"""
