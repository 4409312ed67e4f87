"""Greedy answers through `specgen serve` against a local run, prompt by prompt.

A local run here is `specgen run --no-server`'s path (load the pair, a fresh engine per prompt,
the chat template, greedy); `--cli N` also runs the first N prompts through the real command
for each method. The server is a real `specgen serve` process with its defaults (prefix cache
on), sent each prompt twice one client at a time (the second pass finds its prompt in the
prefix cache), then twice again from CLIENTS clients at once (rows joining batches).

    python benchmarks/server_exactness.py OUT.json [-n 128] [--clients 4] [--methods plain,chain,lookup-chain]

Prints a line per method and pass, and a summary; OUT.json holds every text.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai

from specgen.bench.prompts import load_prompts
from specgen.config import GenerationConfig, Method, ModelSettings
from specgen.decoding import run as driver
from specgen.decoding.build import build_engine, resolve_draft_length
from specgen.decoding.prompts import encode_prompt
from specgen.decoding.views import Silent
from specgen.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specgen.runtime.pair import load

SETS = ("quick", "code-editing", "summarization")  # 4 each: short, medium and the long prompts


def prompts() -> list[str]:
    return [p.text for name in SETS for p in load_prompts(name)[:4] if not p.messages]  # single prompts only


def local(texts: list[str], methods: list[str], new_tokens: int) -> dict[str, list[str]]:
    """Each method's answers as `specgen run --no-server` makes them: a fresh engine per prompt."""
    pair = load(
        ModelSettings(DEFAULT_TARGET, DEFAULT_DRAFT, compile="auto", target_quant="auto", draft_quant="auto"),
        Method.CHAIN,
        quiet=True,
    )
    out = {}
    for method in methods:
        config, _ = resolve_draft_length(
            pair, GenerationConfig(method=Method(method), max_new_tokens=new_tokens, device_draft_tokens=True)
        )
        answers = []
        for text in texts:
            ids = encode_prompt(pair.target.tokenizer, text)
            answers.append(
                driver.generate(build_engine(pair, config), pair.target.tokenizer, ids, config, Silent()).text
            )
        out[method] = answers
        print(f"local {method}: {len(answers)} answers", flush=True)
    return out


def cli(texts: list[str], method: str, new_tokens: int) -> list[str]:
    """The real command, one process per prompt."""
    answers = []
    for text in texts:
        done = subprocess.run(
            ["specgen", "run", text, "--no-server", "--format", "json", "-m", method, "-n", str(new_tokens)],
            capture_output=True,
            text=True,
            check=True,
        )
        answers.append(json.loads(done.stdout)["text"])
    return answers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def served(texts: list[str], methods: list[str], new_tokens: int, clients: int) -> dict:
    port = free_port()
    key = secrets.token_urlsafe(16)
    server = subprocess.Popen(
        ["specgen", "serve", "--port", str(port), "--api-key", key],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=600)
    try:
        deadline = time.monotonic() + 900
        while True:
            try:
                model = client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server did not start: {server.stderr.read()[-2000:]}") from None
                time.sleep(1)

        def answer(text: str, method: str) -> str:
            reply = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": text}],
                max_tokens=new_tokens,
                temperature=0,
                extra_body={"speculative": {"method": method}},
            )
            return reply.choices[0].message.content

        out = {}
        for method in methods:
            for width in (1, clients):
                for attempt in (1, 2):
                    started = time.perf_counter()
                    with ThreadPoolExecutor(width) as pool:
                        texts_back = list(pool.map(lambda t: answer(t, method), texts))
                    out[f"{method}, {width} client{'s' if width > 1 else ''}, pass {attempt}"] = {
                        "answers": texts_back,
                        "seconds": round(time.perf_counter() - started, 1),
                    }
                    print(
                        f"served {method} {width} clients pass {attempt}: "
                        f"{time.perf_counter() - started:.0f} s",
                        flush=True,
                    )
        return out
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("-n", type=int, default=128)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--methods", default="plain,chain,lookup-chain")
    parser.add_argument(
        "--cli", type=int, default=0, help="also run the first N prompts through `specgen run`"
    )
    args = parser.parse_args()
    methods = args.methods.split(",")
    texts = prompts()
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.processor() or platform.machine(),
        "cpu_flags": [f for f in flags if f.startswith(("avx", "amx"))],
        "new_tokens": args.n,
        "prompts": texts,
    }
    record["local"] = local(texts, methods, args.n)
    if args.cli:
        record["cli"] = {m: cli(texts[: args.cli], m, args.n) for m in methods}
    record["served"] = served(texts, methods, args.n, args.clients)
    reference = record["local"][methods[0]]
    summary = {}
    for key, run in (
        [(f"local {m}", {"answers": a}) for m, a in record["local"].items()]
        + [(f"cli {m}", {"answers": a}) for m, a in record.get("cli", {}).items()]
        + list(record["served"].items())
    ):
        same = sum(a == b for a, b in zip(run["answers"], reference))
        summary[key] = f"{same}/{len(run['answers'])} identical to local {methods[0]}"
        print(f"{key}: {summary[key]}")
    record["summary"] = summary
    with open(args.out, "w") as fh:
        json.dump(record, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
