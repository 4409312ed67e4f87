# Does llama-cpp-python's build survive a completion on this CPU? Load a GGUF, 32 greedy tokens after a
# 197-token
# prompt, twice (python benchmarks/llamacpp_probe.py [GGUF]; outputs in
# results/llamacpp-xeon-amx-2026-11-26/probe-*.txt).
import sys
import time

import llama_cpp

GGUF = sys.argv[1] if len(sys.argv) > 1 else "/root/.cache/specgen/gguf/qwen2.5-coder-1.5b-instruct.gguf"
print("llama_cpp", llama_cpp.__version__, flush=True)
t0 = time.perf_counter()
llm = llama_cpp.Llama(model_path=GGUF, n_ctx=2048, n_threads=2, verbose=False)
print(f"load {time.perf_counter() - t0:.2f}s", flush=True)
prompt = "The quick brown fox jumps over the lazy dog near the river bank. " * 14
print("prompt tokens", len(llm.tokenize(prompt.encode())), flush=True)
t0 = time.perf_counter()
out = llm.create_completion(prompt, max_tokens=32, temperature=0)
dt = time.perf_counter() - t0
n = out["usage"]["completion_tokens"]
print(f"completion_tokens={n} wall={dt:.2f}s tok/s={n / dt:.2f} (incl. prefill)", flush=True)
# decode-only estimate: second run reuses prefix cache? measure separately
t0 = time.perf_counter()
out2 = llm.create_completion(prompt, max_tokens=32, temperature=0)
dt2 = time.perf_counter() - t0
print(f"second run wall={dt2:.2f}s tok/s={out2['usage']['completion_tokens'] / dt2:.2f}", flush=True)
print("text:", repr(out["choices"][0]["text"]), flush=True)
