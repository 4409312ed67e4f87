"""Two streams decoding while a long prompt arrives, with and without chunked prefill.

One in-process server on the default pair (prefix cache off). STREAMS clients stream short
requests back to back; after a second, one more client sends a long prompt (about LONG tokens of
this repository's engine source, "summarize it"). Measured per run: the longest pause between two
chunks of the running streams while the long prompt is prefilled, their pauses' p95, and the
long request's time to first token. `--prefill-chunk` values (256, the default on a CPU, against
0, whole), alternating, RUNS runs each.

    python benchmarks/chunked_prefill.py OUT.json [--runs 2] [--long 1200] [--method chain] [--chunks 256,0]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import threading
import time
from pathlib import Path

import openai

from specgen.config import Method, ModelSettings
from specgen.decoding.prompts import encode_prompt
from specgen.runtime.pair import load
from specgen.serve.server import ServeOptions, prepare

SHORT = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash map is in two paragraphs.",
]


def long_prompt(tokenizer, tokens: int) -> str:
    source = (Path(__file__).parent.parent / "specgen" / "decoding" / "engine.py").read_text()
    ids = tokenizer(source)["input_ids"][:tokens]
    return "Summarize what this code does:\n\n" + tokenizer.decode(ids)


def stream(client, model: str, content: str, method: str, max_tokens: int, arrivals: list[float]) -> float:
    """Streams one request; appends each content chunk's arrival time; returns the time to first token."""
    started = time.perf_counter()
    first = None
    for chunk in client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"speculative": {"method": method}},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            arrivals.append(now)
            first = first or now
    return (first or time.perf_counter()) - started


def one_run(client, model: str, prompt: str, args) -> dict:
    stop = threading.Event()
    arrivals: list[list[float]] = [[] for _ in SHORT]

    def decoder(i: int) -> None:
        while not stop.is_set():
            times: list[float] = []
            stream(client, model, SHORT[i], args.method, 48, times)
            arrivals[i].append(times)

    threads = [threading.Thread(target=decoder, args=(i,)) for i in range(len(SHORT))]
    for thread in threads:
        thread.start()
    time.sleep(4.0)  # both streams decoding
    sent = time.perf_counter()
    ttft = stream(client, model, prompt, args.method, 16, [])
    done = time.perf_counter()
    stop.set()
    for thread in threads:
        thread.join()
    gaps = []  # pauses between two chunks of one request, while the long prompt was in flight
    for requests in arrivals:
        for times in requests:
            gaps += [b - a for a, b in zip(times, times[1:]) if b > sent and a < sent + ttft]
    return {
        "long_ttft": ttft,
        "long_seconds": done - sent,
        "max_gap": max(gaps, default=0.0),
        "p95_gap": statistics.quantiles(gaps, n=20)[-1] if len(gaps) >= 2 else max(gaps, default=0.0),
        "gaps": len(gaps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--long", type=int, default=1200)
    parser.add_argument("--method", default="chain")
    parser.add_argument("--chunks", default="256,0", help="--prefill-chunk values to compare (0: whole)")
    args = parser.parse_args()
    settings = ModelSettings("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
    pair = load(settings, Method.CHAIN, quiet=True)
    running = prepare(
        settings, ServeOptions(port=0, prefix_cache=0), quiet=True, pair=pair, log=io.StringIO()
    )
    threading.Thread(target=running.serve_until_stopped, daemon=True).start()
    time.sleep(1.0)
    client = openai.OpenAI(
        base_url=running.state.info["url"] + "/v1", api_key=running.token, max_retries=0, timeout=900
    )
    model, scheduler = running.state.model_id, running.scheduler
    prompt = long_prompt(pair.target.tokenizer, args.long)
    results: dict[str, list[dict]] = {}
    for _ in range(args.runs):
        for chunk in [int(c) for c in args.chunks.split(",")]:
            scheduler.prefill_chunk = (
                chunk  # an engine's policy is fixed when built: the next request builds anew
            )
            scheduler.engine = None
            name = f"chunk {chunk}" if chunk else "whole"
            result = one_run(client, model, prompt, args)
            results.setdefault(name, []).append(result)
            print(
                f"{name}: long prompt first token {result['long_ttft']:.2f} s (done "
                f"{result['long_seconds']:.2f} s); "
                f"the streams' longest pause {result['max_gap']:.2f} s, p95 {result['p95_gap']:.2f} s "
                f"({result['gaps']} pauses)",
                flush=True,
            )
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    prompt_tokens = len(encode_prompt(pair.target.tokenizer, prompt, False, None))
    with open(args.out, "w") as f:
        json.dump(
            {"args": vars(args), "prompt_tokens": prompt_tokens, "results": results, "lscpu": lscpu},
            f,
            indent=1,
        )
    running.should_exit = True


if __name__ == "__main__":
    main()
