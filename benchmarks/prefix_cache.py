"""Multi-user chats over the HTTP server, with and without its prefix cache (`--prefix-cache`).

USERS users take turns through one server on the default pair (user 1's turn 1, user 2's turn
1, user 1's turn 2, ...). Each turn sends the whole conversation, as chat clients do, under one
shared system prompt. The engine keeps the row of the request it served last (a local chat's
next turn resumes it), but here the next request is always the other user's: without the
prefix cache every turn prefills its whole conversation again; with it, a turn copies the K/V
of its own previous turn (and the first turns the system prompt's) and prefills only what is
new. Greedy, so both phases' replies can be compared token for token.

Then a burst: CLIENTS requests at once, different questions under the same system prompt.

    python benchmarks/prefix_cache.py OUT.json [--turns 5] [--users 2] [--method chain] [-n 32]

Prints a line per request and a summary; OUT.json holds every request's timings.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import threading
import time

import openai

from specgen.config import Method, ModelSettings
from specgen.runtime.pair import load
from specgen.serve.server import ServeOptions, prepare

SYSTEM = (
    "You are a concise coding assistant for a team that writes Python services. Answer in a few "
    "sentences, show code only when asked, prefer the standard library, and say when you are unsure."
)
TURNS = [
    [
        "Write a Python function that reverses a linked list.",
        "Now add type hints.",
        "What is its time complexity?",
        "Rewrite it recursively.",
        "Which version would you use, and why?",
    ],
    [
        "How do I read a large CSV file without loading it all into memory?",
        "And if it is gzipped?",
        "How would I count the rows per value of one column?",
        "Make that a function with a docstring.",
        "How would you test it?",
    ],
    [
        "Explain what a Python generator is.",
        "When would you use one instead of a list?",
        "Show a generator that yields primes.",
        "How do I take the first ten of them?",
        "What does yield from do?",
    ],
]
BURST = ["What is a mutex?", "Explain big-O notation.", "What does git rebase do?", "What is a closure?"]


def stream(client, model: str, messages: list[dict], method: str, max_tokens: int) -> dict:
    started = time.perf_counter()
    first, text, usage = None, [], None
    for chunk in client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"speculative": {"method": method}},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    end = time.perf_counter()
    return {
        "ttft": (first or end) - started,
        "seconds": end - started,
        "text": "".join(text),
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": usage.prompt_tokens_details.cached_tokens,
    }


def chats(client, model: str, args) -> list[dict]:
    histories = [[{"role": "system", "content": SYSTEM}] for _ in range(args.users)]
    out = []
    for turn in range(args.turns):
        for user in range(args.users):
            history = histories[user]
            history.append({"role": "user", "content": TURNS[user % len(TURNS)][turn % 5]})
            result = stream(client, model, history, args.method, args.max_new_tokens)
            history.append({"role": "assistant", "content": result["text"]})
            out.append({"user": user, "turn": turn + 1, **result})
            print(
                f"  user {user + 1} turn {turn + 1}: prompt {result['prompt_tokens']} tokens, "
                f"{result['cached_tokens']} cached; first token {result['ttft']:.2f} s, "
                f"all {result['seconds']:.2f} s",
                flush=True,
            )
    return out


def burst(client, model: str, args) -> list[dict]:
    results: list[dict] = [{} for _ in BURST]

    def ask(i: int) -> None:
        results[i] = stream(
            client,
            model,
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": BURST[i]}],
            args.method,
            args.max_new_tokens,
        )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(BURST))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        print(
            f"  burst: prompt {result['prompt_tokens']} tokens, {result['cached_tokens']} cached; "
            f"first token {result['ttft']:.2f} s",
            flush=True,
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--users", type=int, default=2)
    parser.add_argument("--method", default="chain")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    settings = ModelSettings("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
    pair = load(settings, Method.CHAIN, quiet=True)
    running = prepare(settings, ServeOptions(port=0), quiet=True, pair=pair, log=io.StringIO())
    threading.Thread(target=running.serve_until_stopped, daemon=True).start()
    time.sleep(1.0)
    client = openai.OpenAI(
        base_url=running.state.info["url"] + "/v1", api_key=running.token, max_retries=0, timeout=600
    )
    model = running.state.model_id
    phases = {}
    for mib in (0, 256, 0, 256):  # each twice, alternating: the VM's speed drifts
        pair.keep_prefixes(mib)
        pair.target_prefixes.clear()
        pair.draft_prefixes.clear()
        name = f"cache {mib} MiB" if mib else "no cache"
        print(f"{name}:", flush=True)
        phases.setdefault(name, []).append(
            {"chats": chats(client, model, args), "burst": burst(client, model, args)}
        )
    summary = {}
    for name, runs in phases.items():
        later = [r["ttft"] for run in runs for r in run["chats"] if r["turn"] > 1]
        bursts = [r["ttft"] for run in runs for r in run["burst"]]
        summary[name] = {
            "ttft_p50_later_turns": statistics.median(later),
            "ttft_mean_later_turns": statistics.mean(later),
            "burst_ttft_p50": statistics.median(bursts),
            "chat_seconds": sum(r["seconds"] for run in runs for r in run["chats"]) / len(runs),
        }
        print(
            f"{name}: turns 2+: first token p50 {summary[name]['ttft_p50_later_turns']:.2f} s, mean "
            f"{summary[name]['ttft_mean_later_turns']:.2f} s; burst first token p50 "
            f"{summary[name]['burst_ttft_p50']:.2f} s; the chats took {summary[name]['chat_seconds']:.1f} s"
        )
    texts = {name: [[r["text"] for r in run["chats"]] for run in runs] for name, runs in phases.items()}
    same = all(t == texts["no cache"][0] for runs in texts.values() for t in runs)
    print("replies identical in every phase:", same)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    with open(args.out, "w") as f:
        json.dump(
            {"args": vars(args), "summary": summary, "phases": phases, "identical": same, "lscpu": lscpu},
            f,
            indent=1,
        )
    running.should_exit = True


if __name__ == "__main__":
    main()
