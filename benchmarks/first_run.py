"""The first run and a warm start of `specgen run` on the default pair: wall time, the peak
resident memory of the whole process tree (a first run builds the draft's int8 store in a
second process, which `/usr/bin/time` would not add), and what the cache holds after.

    python benchmarks/first_run.py OUT_DIR [--cache DIR] [--warm N]

The cache directory (default: a fresh temporary one) is emptied first, then `specgen run
"Write a haiku about caches" -n 32 --no-server --format plain` runs once cold and N times warm
(default 2); `FIRST_RUN_ARGS` in the environment adds options to it. Each line of the
command's stderr is stamped with the seconds since its start, so the log shows where the time
goes. The RSS of the command, of its children and the anonymous part of both (without a mapped
file's pages, which are dropped rather than swapped when memory is short) is sampled every
0.2 s into a `.rss.tsv` beside each log; the JSON says when the peak came, how it split
between the command and its children, and the anonymous peak. Results: OUT_DIR/first-run.json
and one log per run.
Never run it beside another heavy job: it times the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

COMMAND = ["specgen", "run", "Write a haiku about caches", "-n", "32", "--no-server", "--format", "plain"]
EXTRA = os.environ.get("FIRST_RUN_ARGS", "").split()  # e.g. "--dtype float32 --target-quant int8"


def tree_rss(process: psutil.Process) -> tuple[int, int, int]:
    """Resident bytes right now: of `process`, of all its descendants together, and the anonymous
    part of both (RSS less file-backed and shared pages: what memory pressure is made of; a
    memory-mapped file's pages count in RSS but are dropped, not swapped, when memory is short)."""
    info = process.memory_info()
    own, anonymous, children = info.rss, info.rss - info.shared, 0
    for p in process.children(recursive=True):
        try:
            info = p.memory_info()
        except psutil.Error:
            continue
        children += info.rss
        anonymous += info.rss - info.shared
    return own, children, anonymous


def run(cache: Path, log: Path) -> dict:
    env = {**os.environ, "SPECGEN_CACHE": str(cache)}
    start = time.perf_counter()
    child = subprocess.Popen(
        COMMAND + EXTRA, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    timeline: list[
        tuple[float, int, int, int]
    ] = []  # (seconds, the command's RSS, its children's, anonymous)
    done = threading.Event()

    def sample() -> None:
        watched = psutil.Process(child.pid)
        while not done.is_set():
            try:
                timeline.append((time.perf_counter() - start, *tree_rss(watched)))
            except psutil.Error:
                break
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with open(log, "w") as out:
        for line in child.stdout:
            out.write(f"{time.perf_counter() - start:7.1f} {line}")
    code = child.wait()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    with open(log.with_suffix(".rss.tsv"), "w") as out:
        out.write("seconds\tcommand_gb\tchildren_gb\tanonymous_gb\n")
        out.writelines(
            f"{t:.1f}\t{own / 1e9:.3f}\t{kids / 1e9:.3f}\t{anon / 1e9:.3f}\n"
            for t, own, kids, anon in timeline
        )
    at, own, kids, _ = max(timeline, key=lambda sample: sample[1] + sample[2], default=(0.0, 0, 0, 0))
    anonymous = max((sample[3] for sample in timeline), default=0)
    return {
        "seconds": round(seconds, 1),
        "peak_rss_gb": round((own + kids) / 1e9, 2),
        "exit": code,
        "peak_at_s": round(at, 1),
        "peak_split_gb": [round(own / 1e9, 2), round(kids / 1e9, 2)],
        "peak_anonymous_gb": round(anonymous / 1e9, 2),
    }


def disk(cache: Path) -> dict:
    sizes = {}
    for entry in sorted(cache.rglob("*")):
        if entry.is_file():
            top = entry.relative_to(cache).parts[:2]
            key = "/".join(top)
            sizes[key] = sizes.get(key, 0) + entry.stat().st_size
    return {key: round(size / 1e9, 3) for key, size in sizes.items() if size > 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--cache", type=Path)
    parser.add_argument("--warm", type=int, default=2)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cache = args.cache or Path(tempfile.mkdtemp(prefix="specgen-first-run-"))
    shutil.rmtree(cache, ignore_errors=True)
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    result = {
        "command": COMMAND + EXTRA,
        "cpu": [line for line in flags.splitlines() if line.startswith(("Model name", "Flags"))],
    }
    result["first"] = run(cache, args.out / "first.log")
    result["disk_gb"] = disk(cache)
    result["disk_total_gb"] = round(sum(result["disk_gb"].values()), 2)
    result["warm"] = [run(cache, args.out / f"warm-{i + 1}.log") for i in range(args.warm)]
    (args.out / "first-run.json").write_text(json.dumps(result, indent=1) + "\n")
    json.dump({k: v for k, v in result.items() if k != "cpu"}, sys.stdout, indent=1)
    print()
    if not args.cache:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
