"""`specgen chat` on a server against `specgen chat --no-server`, turn by turn.

    python benchmarks/chat_served.py OUT.json [-n 96] [--rounds 2]

The same scripted conversation (TURNS, greedy, `-n` new tokens a turn, the default pair and
every default) is piped into `specgen chat --format json` in its own process (`--no-server`)
and then through a `specgen serve` started with the same model options (which chat finds and
uses), alternately, `--rounds` times each. Per turn: decode tok/s (the chat's own statistics),
time to first token, and whether the texts are the same.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import threading
import time

TURNS = [
    "Write a Python function that reverses a linked list.",
    "Now add type hints and a docstring.",
    "What is its time complexity, and why?",
    "Rewrite it recursively.",
]


def chat(new_tokens: int, server: bool) -> list[dict]:
    script = "\n".join(TURNS) + "\n"
    done = subprocess.run(
        [
            "specgen",
            "chat",
            "--format",
            "json",
            "-n",
            str(new_tokens),
            "--server" if server else "--no-server",
        ],
        input=script,
        capture_output=True,
        text=True,
        check=True,
        timeout=3600,
    )
    turns = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if len(turns) != len(TURNS):
        raise SystemExit(f"expected {len(TURNS)} turns, got {len(turns)}: {done.stderr[-1000:]}")
    return [
        {
            "text": t["text"],
            "tok_s": t["stats"]["tokens_per_second"],
            "ttft": t["stats"]["time_to_first_token"],
            "reused": t["reused_tokens"],
            "new_tokens": t["stats"]["new_tokens"],
        }
        for t in turns
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("-n", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    server = subprocess.Popen(
        ["specgen", "serve"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    runs = {"no-server": [], "server": []}
    try:
        for line in server.stderr:  # "server ready at ..." once it answers
            if "server ready" in line:
                break
        else:
            raise SystemExit("the server did not start")
        threading.Thread(target=server.stderr.read, daemon=True).start()  # its log lines: never a full pipe
        for _ in range(args.rounds):
            runs["no-server"].append(chat(args.n, server=False))
            runs["server"].append(chat(args.n, server=True))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu_flags": [f for f in flags if f.startswith(("avx", "amx"))],
        "new_tokens": args.n,
        "turns": TURNS,
        "runs": runs,
        "per_turn": [],
    }
    print("turn | no-server tok/s | server tok/s | ratio | TTFT no-server / server | same text")
    for i in range(len(TURNS)):
        local = statistics.median(r[i]["tok_s"] for r in runs["no-server"])
        served = statistics.median(r[i]["tok_s"] for r in runs["server"])
        ttft = (
            statistics.median(r[i]["ttft"] for r in runs["no-server"]),
            statistics.median(r[i]["ttft"] for r in runs["server"]),
        )
        same = all(
            r[i]["text"] == runs["no-server"][0][i]["text"] for r in runs["no-server"] + runs["server"]
        )
        record["per_turn"].append(
            {
                "turn": i + 1,
                "no_server": local,
                "server": served,
                "ratio": served / local,
                "ttft": ttft,
                "same_text": same,
            }
        )
        print(
            f"{i + 1} | {local:.2f} | {served:.2f} | {served / local:.3f} | {ttft[0]:.2f} / {ttft[1]:.2f} | "
            f"{same}"
        )
    with open(args.out, "w") as fh:
        json.dump(record, fh, indent=1)


if __name__ == "__main__":
    main()
