"""Could llama.cpp verify drafts exactly, and at what cost? Two questions about its CPU kernels
on the target's own GGUF, answered in one process (run it with a Python that has
llama-cpp-python; specgen itself is not imported):

1. **Row-exact?** A token's logits from a one-token decode against the same token's logits
   inside a decode of w tokens (a verify of w - 1 drafted tokens), bitwise, for w up to 17. A
   speculative decoder is lossless only where the two agree: a greedy verify then takes exactly
   the tokens plain decoding would.
2. **What a verify costs:** the decode of w tokens over a cached context, in one-token decodes
   (the plain step), w = 1..17, timed in turn so that the machine's drift moves them together.

    python benchmarks/llamacpp_verify.py [--gguf PATH] [--context 200] [--tokens 48] [--repeats 11]

llama-cpp-python's `Llama.eval` removes the cache past `n_tokens` before it decodes, so setting
`n_tokens` back rolls a verify back, as llama.cpp's own speculative example does with
`llama_memory_seq_rm`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

import numpy as np
from llama_cpp import Llama

PROMPT = (
    "Translate the following text from English to German:\n\nThe meeting has been moved to Thursday "
    "at 10 a.m. Please bring the updated budget figures. We will also review the hiring plan for the "
    "next quarter. "
)
WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17)


def cpu_flags() -> str:
    flags = "lscpu | grep -o -w -E 'avx|avx2|avx512[a-z_0-9]*|amx[a-z_0-9]*|f16c|fma' | sort -u"
    return " ".join(subprocess.run(flags, shell=True, capture_output=True, text=True).stdout.split())


def context_ids(llm: Llama, context: int) -> list[int]:
    ids = llm.tokenize(PROMPT.encode())
    while len(ids) < context:
        ids += llm.tokenize(PROMPT.encode(), add_bos=False)
    return ids[:context]


def logits_by_width(llm: Llama, prompt: list[int], text: list[int], width: int) -> np.ndarray:
    """The logits of every position of `text` after `prompt`, decoding `width` tokens at a time."""
    llm.n_tokens = 0
    llm.eval(prompt)
    rows = []
    for i in range(0, len(text), width):
        chunk = text[i : i + width]
        start = llm.n_tokens
        llm.eval(chunk)
        rows.append(np.array(llm.scores[start : start + len(chunk)], dtype=np.float32))
    return np.concatenate(rows)


def greedy(llm: Llama, prompt: list[int], tokens: int) -> list[int]:
    llm.n_tokens = 0
    llm.eval(prompt)
    out: list[int] = []
    for _ in range(tokens):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(out[-1:])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = os.path.expanduser("~/.cache/specgen/gguf/qwen2.5-coder-1.5b-instruct.gguf")
    parser.add_argument("--gguf", default=default)
    parser.add_argument("--context", type=int, default=200, help="cached tokens before the verify")
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens scored at each width")
    parser.add_argument("--repeats", type=int, default=11, help="turns of the timed decodes")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    import llama_cpp

    print(f"cpu flags: {cpu_flags()}; llama-cpp-python {llama_cpp.__version__}; {args.threads} threads")
    print(f"gguf: {args.gguf}")
    llm = Llama(
        model_path=args.gguf,
        n_ctx=args.context + max(args.tokens, max(WIDTHS)) + 8,
        n_batch=512,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        logits_all=True,
        verbose=False,
    )
    prompt = context_ids(llm, args.context)

    # 1. row-exactness: one-token decodes against decodes of w tokens
    text = greedy(llm, prompt, args.tokens)
    one = logits_by_width(llm, prompt, text, 1)
    print(f"\n1. {args.tokens} greedy tokens after {len(prompt)}: each scored alone against within w tokens")
    print("   w  max |difference|  positions not bitwise equal  argmax differs")
    again = logits_by_width(llm, prompt, text, 1)  # the control: one-token decodes again
    changed = int(np.sum(np.any(again != one, axis=1)))
    print(f"  1 again {float(np.max(np.abs(again - one))):10.3g}  {changed:12d} of {len(text)}")
    for width in WIDTHS[1:]:
        wide = logits_by_width(llm, prompt, text, width)
        differs = int(np.sum(np.any(wide != one, axis=1)))
        argmax = int(np.sum(np.argmax(wide, axis=1) != np.argmax(one, axis=1)))
        largest = float(np.max(np.abs(wide - one)))
        print(f"  {width:2d}  {largest:16.3g}  {differs:12d} of {len(text)}  {argmax:14d}")

    # 2. a verify's cost in plain steps, widths timed in turn
    llm.n_tokens = 0
    llm.eval(prompt)
    seconds: dict[int, list[float]] = {width: [] for width in WIDTHS}
    ratios: dict[int, list[float]] = {width: [] for width in WIDTHS}
    tokens = text + text
    for repeat in range(args.repeats + 1):
        turn = {}
        for width in WIDTHS if repeat % 2 else WIDTHS[::-1]:
            llm.n_tokens = len(prompt)
            started = time.perf_counter()
            llm.eval(tokens[:width])
            turn[width] = time.perf_counter() - started
        if repeat == 0:
            continue  # warm-up
        for width in WIDTHS:
            seconds[width].append(turn[width])
            ratios[width].append(turn[width] / turn[1])
    print(f"\n2. a decode of w tokens over {len(prompt)} cached, medians of {args.repeats} turns")
    print("   w  ms      in one-token decodes")
    for width in WIDTHS:
        ms, steps = 1e3 * statistics.median(seconds[width]), statistics.median(ratios[width])
        print(f"  {width:2d}  {ms:6.1f}  {steps:5.2f}")


if __name__ == "__main__":
    main()
