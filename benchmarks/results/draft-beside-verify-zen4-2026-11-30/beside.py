"""Would drafting on one core while the target verifies on the other pay on a 2-core CPU?

The default pair as specgen loads it (int8 target, int8 pruned draft, the lean forward), a
200-token context. Per repeat, taking turns:
  * serial: a 2-token verify of the target, then N one-token draft steps, both on 2 threads
    (what a round does today);
  * beside: the same verify on 1 thread in one Python thread while the N draft steps run on
    1 thread in another (torch's ops release the GIL; each thread sets its own OpenMP count);
  * the parts alone: the verify and the draft step on 1 and on 2 threads.
Parallel speculative decoding (drafting the next round during this round's verify) can at
best hide the draft's steps: its round is the `beside` wall, against today's `serial`.

    python beside.py [--repeats 15] [--steps 1,2,3]
"""

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cpu_profile import cpu_flags  # noqa: E402
from outside_products import default_pair  # noqa: E402

from specgen.runtime import kvcache  # noqa: E402
from specgen.runtime.lean import LeanForward  # noqa: E402

CONTEXT = 200


def prepared(model, exact: bool):
    forward, cache = LeanForward(model, exact), kvcache.new_cache(model)
    kvcache.forward(forward, cache, torch.arange(1000, 1000 + CONTEXT)[None], keep=1)
    return forward, cache


def steps(prepared_model, width: int, count: int = 1, threads: int | None = None) -> None:
    if threads:
        torch.set_num_threads(threads)
    forward, cache = prepared_model
    tokens = torch.arange(2000, 2000 + width)[None]
    for _ in range(count):
        kvcache.forward(forward, cache, tokens, keep=width)
        kvcache.crop(cache, CONTEXT)


def wall(call) -> float:
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1e3


def beside(target, draft, count: int) -> None:
    one = threading.Thread(target=steps, args=(target, 2, 1, 1))
    other = threading.Thread(target=steps, args=(draft, 1, count, 1))
    one.start(), other.start()
    one.join(), other.join()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", default="1,2,3")
    args = parser.parse_args()
    counts = [int(n) for n in args.steps.split(",")]
    pair = default_pair()
    target, draft = prepared(pair.target.model, True), prepared(pair.draft.model, False)
    cells = {
        "verify, 2 threads": lambda: steps(target, 2, 1, 2),
        "verify, 1 thread": lambda: steps(target, 2, 1, 1),
        "draft step, 2 threads": lambda: steps(draft, 1, 1, 2),
        "draft step, 1 thread": lambda: steps(draft, 1, 1, 1),
    }
    for n in counts:
        cells[f"serial: verify + {n} draft, 2 threads"] = lambda n=n: (
            steps(target, 2, 1, 2),
            steps(draft, 1, n, 2),
        )
        cells[f"beside: verify || {n} draft, 1 thread each"] = lambda n=n: beside(target, draft, n)
    for call in cells.values():  # warm
        call(), call()
    walls = {name: [] for name in cells}
    for repeat in range(args.repeats):
        order = list(cells) if repeat % 2 == 0 else list(reversed(cells))
        for name in order:
            walls[name].append(wall(cells[name]))
    torch.set_num_threads(2)
    print(f"# {cpu_flags()}; torch {torch.__version__}; context {CONTEXT}; medians of {args.repeats}")
    for name, values in walls.items():
        q = statistics.quantiles(values, n=4)
        print(f"{name:42s} {statistics.median(values):7.1f} ms  (quartiles {q[0]:.1f}-{q[2]:.1f})")
    for n in counts:
        serial = statistics.median(walls[f"serial: verify + {n} draft, 2 threads"])
        side = statistics.median(walls[f"beside: verify || {n} draft, 1 thread each"])
        print(f"{n} draft step(s): beside / serial = {side / serial:.2f}")


if __name__ == "__main__":
    main()
