"""Chat memory over many turns: the RSS of a `specgen chat` process after every turn.

Usage:
    python benchmarks/chat_memory.py [--turns 300] [--dtype bfloat16] [--method chain]
                                     [--target DIR --draft DIR] [--context 1024] [--json OUT]

Runs `specgen chat` as users run it (a scripted session on a pipe), sends one line per turn
once the previous reply has finished, and reads the process's VmRSS from /proc after each
turn. Without --target/--draft it builds the tiny random pair of the tests (2 layers, context
--context) in a temp directory, so the conversation is trimmed (oldest turns dropped) after a
few dozen turns and every later turn runs at a full context. Prints RSS at turns 1, 10, 30,
then every 30, and the growth after warm-up (turn 30 to the last): the chat holds memory flat
when that growth stays within 15%.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARM_UP = 30


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def tiny_pair(directory: Path, context: int) -> tuple[Path, Path]:
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import save_tiny  # the tests' tiny models: a fixed seed, saved the way users' models are

    target, draft = directory / "target", directory / "draft"
    save_tiny(target, 1, context=context, layers=2, hidden=64)
    save_tiny(draft, 2, context=context, layers=1, hidden=64)
    return target, draft


def measure(args, target: Path, draft: Path) -> list[float]:
    command = [
        sys.executable,
        "-m",
        "specgen",
        "chat",
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--dtype",
        args.dtype,
        "--method",
        args.method,
        "-n",
        str(args.new_tokens),
    ]
    child = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    samples = []
    try:
        for turn in range(1, args.turns + 1):
            child.stdin.write(f"turn {turn}: tell me about the number {turn * 7919 % 1000} and its friends\n")
            child.stdin.flush()
            for line in child.stderr:  # stats on stderr: "[chain] ...", then "turn N: conversation ..."
                if line.startswith(f"turn {turn}:"):
                    break
            else:
                raise SystemExit(f"chat ended before turn {turn} finished (exit {child.wait()})")
            samples.append(rss_mb(child.pid))
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--method", default="chain")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("--json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.target and args.draft:
            target, draft = Path(args.target), Path(args.draft)
        else:
            target, draft = tiny_pair(Path(tmp), args.context)
        samples = measure(args, target, draft)
    shown = sorted(
        {1, 10, WARM_UP, *range(60, len(samples) + 1, 30), len(samples)} & set(range(1, len(samples) + 1))
    )
    print(f"dtype {args.dtype}, method {args.method}, {len(samples)} turns of -n {args.new_tokens}")
    for turn in shown:
        print(f"  turn {turn:4d}: RSS {samples[turn - 1]:7.1f} MB")
    if len(samples) > WARM_UP:
        base = samples[WARM_UP - 1]
        print(
            f"  after warm-up (turn {WARM_UP} -> {len(samples)}): {100 * (samples[-1] / base - 1):+.1f}%, "
            f"peak {100 * (max(samples[WARM_UP - 1 :]) / base - 1):+.1f}%"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"dtype": args.dtype, "method": args.method, "rss_mb": samples})
        )


if __name__ == "__main__":
    main()
