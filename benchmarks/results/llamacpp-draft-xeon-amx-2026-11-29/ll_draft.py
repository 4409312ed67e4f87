import time, sys
import llama_cpp
from llama_cpp import Llama
path = sys.argv[1]
m = Llama(model_path=path, n_ctx=1024, n_threads=2, n_threads_batch=2, n_batch=256, logits_all=False, verbose=False)
prompt = list(range(1000, 1200))
t = time.perf_counter(); m.eval(prompt); print("prompt 200", time.perf_counter() - t)
times = []
for i in range(40):
    t = time.perf_counter(); m.eval([1500 + i]); times.append(time.perf_counter() - t)
    _ = m.scores[m.n_tokens - 1]
times.sort(); print("1-token eval ms: median %.2f min %.2f" % (times[20]*1e3, times[0]*1e3))
# 2 tokens
times = []
for i in range(20):
    t = time.perf_counter(); m.eval([1600 + i, 1700 + i]); times.append(time.perf_counter() - t)
times.sort(); print("2-token eval ms: median %.2f" % (times[10]*1e3))
