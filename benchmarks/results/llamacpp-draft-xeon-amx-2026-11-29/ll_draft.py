"""llama.cpp's own decode step of a GGUF file (llama-cpp-python's `eval`, 2 threads): a
200-token prompt read, then 1- and 2-token steps. Throwaway measurement behind
int8-kernels.md's "int4 for the draft, and llama.cpp's own draft step":

    python ll_draft.py MODEL.gguf
"""

import sys
import time

from llama_cpp import Llama


def main() -> None:
    model = Llama(
        model_path=sys.argv[1], n_ctx=1024, n_threads=2, n_threads_batch=2, n_batch=256, verbose=False
    )
    started = time.perf_counter()
    model.eval(list(range(1000, 1200)))
    print("prompt 200", time.perf_counter() - started)
    times = []
    for i in range(40):
        started = time.perf_counter()
        model.eval([1500 + i])
        times.append(time.perf_counter() - started)
        _ = model.scores[model.n_tokens - 1]
    times.sort()
    print("1-token eval ms: median %.2f min %.2f" % (times[20] * 1e3, times[0] * 1e3))
    times = []
    for i in range(20):
        started = time.perf_counter()
        model.eval([1600 + i, 1700 + i])
        times.append(time.perf_counter() - started)
    times.sort()
    print("2-token eval ms: median %.2f" % (times[10] * 1e3))


if __name__ == "__main__":
    main()
