"""Time to first token of chat turn 5, with and without cache reuse (benchmarks/chat.md).

Runs the same 5-turn conversation twice through specgen's ChatSession on the default pair:
once keeping both KV caches between turns (a turn prefills only its new tokens), once
prefilling the whole conversation every turn. Greedy, so the replies can be compared too.

    python benchmarks/chat_ttft.py --max-new-tokens 24
"""

from __future__ import annotations

import argparse
import io

from specgen.chat.session import ChatSession
from specgen.cli.render import PlainRenderer
from specgen.config import GenerationConfig, Method, ModelSettings
from specgen.runtime.pair import load

MESSAGES = [
    "Write a Python function that reverses a linked list.",
    "Now add type hints.",
    "What is its time complexity?",
    "Rewrite it recursively.",
    "Which version would you use, and why?",
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--method", default="chain")
    args = parser.parse_args()
    settings = ModelSettings("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
    pair = load(settings, Method.CHAIN, quiet=True)
    config = GenerationConfig(method=Method.parse(args.method), max_new_tokens=args.max_new_tokens)
    replies = {}
    for reuse in (True, False):
        chat = ChatSession(pair, settings, config, "You are a concise coding assistant.", reuse_cache=reuse)
        for message in MESSAGES:
            turn = chat.send(message, PlainRenderer(out=io.StringIO(), err=io.StringIO()))
        stats = turn.outcome.stats
        replies[reuse] = turn.outcome.token_ids
        print(
            f"reuse={reuse!s:5} turn 5: conversation {turn.prompt_tokens} tokens, {turn.reused_tokens} "
            f"reused; "
            f"prefill {stats.prefill_seconds:.2f} s, time to first token {stats.time_to_first_token:.2f} s",
            flush=True,
        )
    print("turn-5 reply identical with and without reuse:", replies[True] == replies[False])


if __name__ == "__main__":
    main()
