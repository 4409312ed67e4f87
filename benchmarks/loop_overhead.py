"""Where a round's time goes: each forward of the target and of the draft, by width, and the rest
(the decode loop's own cost), per method, against plain decoding's step, in one process.

    python benchmarks/loop_overhead.py [--prompts quick] [--ids a,b] \
        [--columns plain,chain,chain@k1,lookup-chain] [-n 64] [--repeats 2]

Every forward of a SlotCache goes through `runtime.kvcache.forward` (the engine's target steps
and verifies, the drafters' steps and prompt reads, the prefill), so a wall-clock timer there
sees each one with its width and the model it ran: the target or the draft. Timers around
`model.forward` would see none of them: the lean forward (runtime/lean.py) runs the layers
itself. torch's CPU ops run synchronously, so the split is exact on a CPU (on CUDA it would need
a synchronize in the timer).

A column is METHOD or METHOD@kN: a fixed draft length N from the first round, with no floor and
no confidence stop (what a row whose floor settled at N drafts). Columns take turns per prompt,
the order reversed every repeat. Per prompt and column it prints the generation's wall time,
the prompt reads (target, draft), every forward kind (count, total, ms a call) and what is left
outside the forwards, and a round's cost in plain steps: (wall - prompt reads) / rounds over
plain's median step of the same prompt and repeat.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import subprocess
import time

from specgen.bench.prompts import encode_all, load_prompts
from specgen.cli.options import generation_config
from specgen.config import Method, ModelSettings
from specgen.decoding import run as driver
from specgen.decoding.build import build_engine, resolve_draft_length
from specgen.decoding.views import Silent
from specgen.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from specgen.runtime import kvcache
from specgen.runtime.pair import load

PREFILL = 20  # a forward this wide or wider is a prompt read, not a step or a verify


class Timers:
    """Wall-clock timers on kvcache.forward, keyed by (model role, width)."""

    def __init__(self, roles: dict[int, str]):
        self.roles, self.calls = roles, []
        self.inner = kvcache.forward

        def forward(call, cache, input_ids, **kwargs):
            started = time.perf_counter()
            try:
                return self.inner(call, cache, input_ids, **kwargs)
            finally:
                role = self.roles.get(id(getattr(call, "model", call)), "other")
                self.calls.append((role, input_ids.shape[1], time.perf_counter() - started))

        kvcache.forward = forward

    def table(self) -> dict[tuple[str, object], list[float]]:
        out: dict[tuple[str, object], list[float]] = collections.defaultdict(list)
        for role, width, seconds in self.calls:
            out[(role, "read" if width >= PREFILL else width)].append(seconds)
        return out


def config_for(base, column: str):
    method, _, variant = column.partition("@")
    config = dataclasses.replace(base, method=Method(method))
    if variant.startswith("k"):
        config = dataclasses.replace(
            config,
            draft_tokens=int(variant[1:]),
            device_draft_tokens=False,
            device_confidence=False,
            draft_confidence=0.0,
            floor=False,
        )
    elif variant:
        raise SystemExit(f"--columns: unknown variant {variant!r} (kN or none)")
    return config


def timed_pair(max_new_tokens: int):
    """The default pair as bench loads it, bench's chain config at `max_new_tokens` (the device's
    k) and Timers on its forwards: (pair, config, timers)."""
    pair = load(
        ModelSettings(DEFAULT_TARGET, DEFAULT_DRAFT, draft_quant="auto", target_quant="auto", compile="auto"),
        Method.CHAIN,
        quiet=True,
    )
    base, _ = resolve_draft_length(
        pair, generation_config(method="chain", max_new_tokens=max_new_tokens), True
    )
    return pair, base, Timers({id(pair.target.model): "target", id(pair.draft.model): "draft"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="quick", help="a prompt set or JSONL file, as bench takes")
    parser.add_argument("--ids", default="", help="only these prompt ids (comma-separated)")
    parser.add_argument("--columns", default="plain,chain,lookup-chain")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    columns = args.columns.split(",")
    if "plain" not in columns:
        columns.insert(0, "plain")
    pair, base, timers = timed_pair(args.max_new_tokens)
    items = load_prompts(args.prompts)
    if args.ids:
        items = [item for item in items if item.id in args.ids.split(",")]
    tokenizer = pair.target.tokenizer
    flags = "lscpu | grep -o -w -E 'avx|avx2|avx512[a-z_0-9]*|amx[a-z_0-9]*|f16c|fma' | sort -u"
    cpu = " ".join(subprocess.run(flags, shell=True, capture_output=True, text=True).stdout.split())
    print(f"cpu flags: {cpu}; default pair, {args.max_new_tokens} new tokens, greedy, k={base.draft_tokens}")
    rounds_in_steps: dict[str, list[float]] = collections.defaultdict(list)
    context = pair.target.context_length
    for item, ids in zip(items, encode_all(tokenizer, items, context)):
        for repeat in range(args.repeats):
            runs = {}
            for column in columns if repeat % 2 == 0 else columns[::-1]:
                config = config_for(base, column)
                engine = build_engine(pair, config)
                pair.memories.clear()  # as bench: no suffix memory of the runs before (its own text only)
                timers.calls.clear()
                started = time.perf_counter()
                result = driver.generate(engine, tokenizer, ids, config, Silent())
                runs[column] = (time.perf_counter() - started, len(result.token_ids), timers.table())
            step = statistics.median(runs["plain"][2][("target", 1)])
            for column in columns:
                wall, tokens, table = runs[column]
                reads = sum(sum(table.get((role, "read"), [])) for role in ("target", "draft"))
                rounds = sum(
                    len(v) for (role, width), v in table.items() if role == "target" and width != "read"
                )
                inside = sum(sum(v) for v in table.values())
                cost = (wall - reads) / rounds / step
                rounds_in_steps[column].append(cost)
                print(
                    f"{item.id} {column:<16} wall {wall:6.2f} s  {tokens} tokens  {rounds} rounds  "
                    f"reads {reads:5.2f} s  outside {wall - inside:5.3f} s  a round {cost:4.2f} plain steps"
                )
                for (role, width), seconds in sorted(table.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
                    print(
                        f"    {role:<6} {width!s:>5}: {len(seconds):4d} calls {sum(seconds):6.2f} s "
                        f"{1e3 * statistics.median(seconds):7.1f} ms a call (median)"
                    )
    print("a round in plain steps (median over prompts and repeats):")
    for column, costs in rounds_in_steps.items():
        print(f"  {column:<16} {statistics.median(costs):.2f} ({min(costs):.2f}-{max(costs):.2f})")


if __name__ == "__main__":
    main()
