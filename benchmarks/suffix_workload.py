"""A repeated-task workload from real code, and a driver that runs it against OpenAI-compatible
servers (specgen's, vLLM's, llama.cpp's), one client, as an agent's loop would.

    python benchmarks/suffix_workload.py build            # writes benchmarks/prompts/suffix-workload.jsonl
    python benchmarks/suffix_workload.py run --url http://127.0.0.1:8123 --key KEY \
        --methods plain lookup-chain suffix --json out.json
    python benchmarks/suffix_workload.py run --url http://127.0.0.1:8200 --label vllm-suffix \
        --model /path/to/model --methods none

`build` takes functions from the source of modules every Python installs (the standard library:
textwrap, shlex, fnmatch, posixpath, statistics, colorsys, calendar, ...): top-level functions
of 8 to 30 lines, in name order, the first `--tasks` of them, each with a small change to ask
for. `run` sends each task's four steps in order, each step's prompt carrying the answer before
it, as an agent does:

1. write: the function written out again, with type hints;
2. rewrite: step 1's answer with one small change (a renamed parameter, a docstring);
3. tests: pytest tests for step 2's answer;
4. retry: step 2 again, word for word (an agent retrying a tool call).

Greedy, so every method must give the same text (the driver checks it against the first
method's). `--methods` are specgen's `speculative.method` values (`none` sends no such field:
another server, or the method its command line chose). Methods take turns task by task, every
other task in reverse order, so that drift hits them alike. Standard library only.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import time
import urllib.request
from pathlib import Path

WORKLOAD = Path(__file__).parent / "prompts" / "suffix-workload.jsonl"
MODULES = ["textwrap", "shlex", "fnmatch", "posixpath", "statistics", "colorsys", "calendar", "glob"]
CHANGES = [
    "rename its first parameter to `value`",
    "add a one-line docstring",
    "rename its first parameter to `text`",
    "add a one-line docstring that says what it returns",
]


def build(tasks: int) -> list[dict]:
    found = []
    for name in MODULES:
        module = importlib.import_module(name)
        for attribute, function in sorted(vars(module).items()):
            if not inspect.isfunction(function) or function.__module__ != name or attribute.startswith("_"):
                continue
            try:
                source = inspect.getsource(function)
            except (OSError, TypeError):
                continue
            if 8 <= len(source.splitlines()) <= 30:
                found.append({"id": f"{name}.{attribute}", "source": source})
    found.sort(key=lambda t: t["id"])
    step = max(1, len(found) // tasks)  # spread over the modules
    chosen = found[::step][:tasks]
    for i, task in enumerate(chosen):
        task["change"] = CHANGES[i % len(CHANGES)]
    return chosen


def steps(task: dict, answers: list[str]) -> str:
    """The prompt of the task's next step, given the answers so far."""
    n = len(answers)
    if n == 0:
        return (
            "Write this Python function out again with type hints added, and nothing else:\n\n"
            f"```python\n{task['source']}```"
        )
    if n in (1, 3):  # step 4 retries step 2 word for word
        return (
            f"Here is a Python function:\n\n```python\n{_code(answers[0])}\n```\n\n"
            f"Rewrite it with one small change: {task['change']}. Reply with the whole function only."
        )
    code = _code(answers[1])
    return f"Here is a Python function:\n\n```python\n{code}\n```\n\nWrite three pytest tests for it."


def _code(answer: str) -> str:
    """The code of an answer (inside its first ``` fence when it has one)."""
    if "```" in answer:
        body = answer.split("```", 2)[1]
        return body.split("\n", 1)[1] if body.startswith("python") else body
    return answer


def post(url: str, key: str, body: dict) -> dict:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=1800) as response:
        return json.loads(response.read())


def run(args) -> dict:
    tasks = [json.loads(line) for line in WORKLOAD.read_text().splitlines()][: args.tasks]
    out: dict[str, list[dict]] = {method: [] for method in args.methods}
    for turn, task in enumerate(tasks):
        for method in args.methods if turn % 2 == 0 else args.methods[::-1]:
            answers: list[str] = []
            for step in range(4):
                body = {
                    "model": args.model,
                    "messages": [{"role": "user", "content": steps(task, answers)}],
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                }
                if method != "none":
                    body["speculative"] = {"method": method}
                started = time.perf_counter()
                answer = post(args.url, args.key, body)
                seconds = time.perf_counter() - started
                text = answer["choices"][0]["message"]["content"]
                answers.append(text)
                tokens = answer["usage"]["completion_tokens"]
                out[method].append(
                    {"task": task["id"], "step": step + 1, "tokens": tokens, "seconds": seconds, "text": text}
                )
                print(
                    f"{method:>13} {task['id']:<28} step {step + 1}: {tokens:4d} tokens "
                    f"{tokens / seconds:6.2f} tok/s",
                    flush=True,
                )
    return out


def summary(results: dict[str, list[dict]], base: str) -> dict:
    """tok/s over the workload (tokens / seconds, all steps), per step, and identical answers."""
    reference = {(r["task"], r["step"]): r["text"] for r in results[base]}
    table = {}
    for method, records in results.items():
        tok_s = sum(r["tokens"] for r in records) / sum(r["seconds"] for r in records)
        by_step = {
            step: sum(r["tokens"] for r in records if r["step"] == step)
            / sum(r["seconds"] for r in records if r["step"] == step)
            for step in range(1, 5)
        }
        same = sum(r["text"] == reference[(r["task"], r["step"])] for r in records)
        table[method] = {"tok_s": tok_s, "by_step": by_step, "identical": f"{same}/{len(records)}"}
    plain = table[base]["tok_s"]
    for method, row in table.items():
        row["speedup"] = row["tok_s"] / plain
        steps_text = " ".join(f"{s}:{v:.1f}" for s, v in row["by_step"].items())
        print(
            f"{method:>13}: {row['tok_s']:6.2f} tok/s  {row['speedup']:.2f}x {base}  steps {steps_text}  "
            f"identical {row['identical']}"
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    made = sub.add_parser("build")
    made.add_argument("--tasks", type=int, default=8)
    ran = sub.add_parser("run")
    ran.add_argument("--url", default="http://127.0.0.1:8000")
    ran.add_argument("--key", default="")
    ran.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ran.add_argument("--methods", nargs="+", default=["plain", "lookup-chain", "suffix"])
    ran.add_argument("--tasks", type=int, default=4)
    ran.add_argument("--max-tokens", type=int, default=192)
    ran.add_argument("--json", type=Path)
    ran.add_argument("--label", default="specgen")
    args = parser.parse_args()
    if args.command == "build":
        WORKLOAD.parent.mkdir(exist_ok=True)
        tasks = build(args.tasks)
        WORKLOAD.write_text("".join(json.dumps(t) + "\n" for t in tasks))
        print(f"{len(tasks)} tasks written to {WORKLOAD} (Python {sys.version.split()[0]})")
        return
    results = run(args)
    table = summary(results, args.methods[0])
    if args.json:
        args.json.write_text(
            json.dumps({"label": args.label, "summary": table, "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
