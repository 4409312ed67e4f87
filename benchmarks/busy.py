"""Speed on a busy machine: plain and chain decoding of the default pair, quiet and with one
busy single-threaded process beside them, threads fitted to the free cores (the default) and
fixed at every core (what torch does by itself).

    python benchmarks/busy.py [--max-new-tokens 64] [--prompts quick] [--json OUT.json]

Every cell is one process's run of each prompt (quiet and busy, methods and thread counts
interleaved, every other prompt in reverse order so that drift hits every cell alike),
timed from the first round to the last token (`tokens_per_second` of the run's JSON); the busy
process is `python -c "while True: pass"`, started before the run's models load and stopped
after. Prints lscpu's flags; compare only ratios from one run."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def prompts(name: str) -> list[str]:
    lines = (ROOT / "prompts" / f"{name}.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines if "prompt" in json.loads(line)]


def run(prompt: str, method: str, tokens: int, threads: str | None) -> float:
    """One `specgen run` (its own process, as a user runs it): its decode tok/s."""
    args = [sys.executable, "-m", "specgen", "run", prompt, "--method", method, "-n", str(tokens)]
    args += ["--format", "json", "--no-server"] + (["--threads", threads] if threads else [])
    out = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])["stats"]["tokens_per_second"] or 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompts", default="quick")
    parser.add_argument("--methods", default="plain,chain")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    print(next((line for line in flags.splitlines() if line.startswith("Model name")), ""))
    cells: dict[str, list[float]] = {}
    for turn, prompt in enumerate(prompts(args.prompts)):
        step = 1 if turn % 2 == 0 else -1  # every other prompt in reverse order
        for load in ["quiet", "busy"][::step]:
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "busy" else None
            try:
                time.sleep(0.5 if busy else 0.0)
                for threads in [None, "2"][::step]:
                    for method in args.methods.split(",")[::step]:
                        label = f"{method} {load} threads={'fitted' if threads is None else threads}"
                        rate = run(prompt, method, args.max_new_tokens, threads)
                        cells.setdefault(label, []).append(rate)
                        print(f"{label:<40} {rate:6.2f} tok/s", flush=True)
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
    summary = {label: statistics.median(rates) for label, rates in cells.items()}
    print()
    for label, rate in summary.items():
        method, load, threads = label.split()
        quiet = summary.get(f"{method} quiet {threads}")
        ratio = f"{rate / quiet:.2f}x of quiet" if quiet and load == "busy" else ""
        print(f"{label:<40} {rate:6.2f} tok/s  {ratio}")
    if args.json:
        args.json.write_text(json.dumps({"cells": cells, "median": summary}, indent=1))


if __name__ == "__main__":
    main()
