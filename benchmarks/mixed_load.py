"""Clients of different methods against one `specgen serve`: aggregate throughput of a mixed
load against the same load with one method, and the batch width the server reached.

    python benchmarks/mixed_load.py --url http://127.0.0.1:8000 --key KEY \
        --loads plain:4 lookup-chain:4 plain:2,lookup-chain:2 --requests 3 --max-tokens 64

Each load runs its clients at once, each sending `--requests` requests one after another (greedy,
`ignore_eos`, so every request makes exactly `--max-tokens` tokens), prompts from a prompt set;
the loads take turns `--rounds` times, every other round in reverse order (A B C, C B A, ...),
so steady drift in the machine's speed costs every load the same over an even number of rounds.
Standard library only: it drives any version of the server (the turn-taking one before the mixed
batch too)."""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.request
from pathlib import Path


def prompts(path: Path) -> list[str]:
    out = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "prompt" in record:
            out.append(record["prompt"])
    return out


def post(url: str, key: str, body: dict) -> dict:
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def width(url: str, key: str) -> float:
    request = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("specgen_batch_width "):
                return float(line.split()[1])
    return 0.0


def run_load(args, methods: list[str], texts: list[str], offset: int) -> tuple[float, float, int]:
    """(tokens per second over the load, its seconds, the widest batch seen)."""
    tokens, widest, stop, lock = [0], [0.0], threading.Event(), threading.Lock()

    def client(i: int, method: str) -> None:
        for r in range(args.requests):
            text = texts[(offset + i * args.requests + r) % len(texts)]
            body = {
                "model": args.model,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "speculative": {"method": method},
            }
            made = post(args.url, args.key, body)["usage"]["completion_tokens"]
            with lock:  # clients of one batch finish in the same round: their sums must not race
                tokens[0] += made

    def watch() -> None:
        while not stop.is_set():
            widest[0] = max(widest[0], width(args.url, args.key))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i, m)) for i, m in enumerate(methods)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    stop.set()
    return tokens[0] / seconds, seconds, int(widest[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--key", required=True)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--loads", nargs="+", default=["plain:4", "lookup-chain:4", "plain:2,lookup-chain:2"])
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=Path, default=Path(__file__).parents[1] / "prompts" / "quick.jsonl")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    texts = prompts(args.prompts)
    loads = {
        spec: [m for part in spec.split(",") for m in [part.split(":")[0]] * int(part.split(":")[1])]
        for spec in args.loads
    }
    results: dict[str, list[tuple[float, float, int]]] = {spec: [] for spec in loads}
    for turn in range(args.rounds):
        order = list(enumerate(loads.items()))
        for n, (spec, methods) in order if turn % 2 == 0 else order[::-1]:
            results[spec].append(run_load(args, methods, texts, offset=turn * 7 + n))
            rate, seconds, widest = results[spec][-1]
            print(f"round {turn + 1} {spec}: {rate:.2f} tok/s over {seconds:.1f} s, widest batch {widest}")
    summary = {
        spec: {
            "tok_s": statistics.median(r[0] for r in runs),
            "widest_batch": max(r[2] for r in runs),
            "runs": runs,
        }
        for spec, runs in results.items()
    }
    for spec, s in summary.items():
        print(f"{spec:<28} {s['tok_s']:7.2f} tok/s (median)  widest batch {s['widest_batch']}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
