"""The first run and a warm start of `specgen run` on the default pair: wall time, the peak
resident memory of the whole process tree (a first run builds the draft's int8 store in a
second process, which `/usr/bin/time` would not add), and what the cache holds after.

    python benchmarks/first_run.py OUT_DIR [--cache DIR] [--warm N]

The cache directory (default: a fresh temporary one) is emptied first, then `specgen run
"Write a haiku about caches" -n 32 --no-server --format plain` runs once cold and N times warm
(default 2); `FIRST_RUN_ARGS` in the environment adds options to it. Each line of the command's stderr is stamped with the seconds since its start, so
the log shows where the time goes. Results: OUT_DIR/first-run.json and one log per run.
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


def tree_rss(process: psutil.Process) -> int:
    """Resident bytes of `process` and every descendant, right now."""
    total = 0
    for p in [process, *process.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def run(cache: Path, log: Path) -> dict:
    env = {**os.environ, "SPECGEN_CACHE": str(cache)}
    start = time.perf_counter()
    child = subprocess.Popen(COMMAND + EXTRA, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        watched = psutil.Process(child.pid)
        while not done.is_set():
            try:
                peak[0] = max(peak[0], tree_rss(watched))
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
    return {"seconds": round(seconds, 1), "peak_rss_gb": round(peak[0] / 1e9, 2), "exit": code}


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
    result = {"command": COMMAND + EXTRA, "cpu": [line for line in flags.splitlines() if line.startswith(("Model name", "Flags"))]}
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
