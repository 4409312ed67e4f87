"""Synthetic acceptance, for benchmarks only: a round's accepted length replayed from a recording.

Random-weight models of real shapes (benchmarks/gpu_speed.py) accept nothing, so a chain round
there costs what a real round costs but emits one token. In SYNTHETIC mode (config.Acceptance)
each chain row accepts a length drawn from the accepted-length histogram of a real pair's run
(a bench JSON measured on the CPU), clipped to what the row drafted, and the target adds its own
token at that position: the engine, the caches, the rewinds and the statistics run exactly as
for real acceptances, so speeds are measured end to end instead of projected. The tokens are not
the target's. `specgen run`, `chat` and `serve` never build this mode.

A draw is keyed by (seed, prompt index, position), like deterministic mode's keyed choices: no
state to carry between rounds, the same rounds on every rerun (steady medians), and a row's
rounds do not depend on its batch neighbours.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from bisect import bisect_right
from collections import Counter
from pathlib import Path

import torch

from specgen.config import Acceptance, AcceptanceMode, SamplingConfig
from specgen.decoding.acceptance import Verdict
from specgen.decoding.sampling import sample, warp
from specgen.errors import ConfigError
from specgen.text import json_value

BENCH_SCHEMA = "specgen-bench/1"
DEFAULT_METHOD = "chain"
CHAIN_METHODS = ("chain", "lookup", "lookup-chain", "eagle")  # engine methods whose rounds are chains


def parse(spec: str, option: str = "--synthetic", seed: int = 0) -> Acceptance:
    """'FILE.json' or 'FILE.json:method' (default chain) -> the recording, or one ConfigError line."""
    path, method = spec, DEFAULT_METHOD
    head, sep, tail = spec.rpartition(":")
    if sep and head and not Path(spec).exists():
        path, method = head, tail or DEFAULT_METHOD
    return load(Path(path), method, option, seed)


def load(path: Path, method: str = DEFAULT_METHOD, option: str = "--synthetic", seed: int = 0) -> Acceptance:
    """The accepted-length histogram of `method` in a bench JSON (its per-prompt measurements
    pooled), with the draft length it was recorded at."""
    where = f"{option} {path}"
    if method.split("/")[0] not in CHAIN_METHODS:
        raise ConfigError(
            f"{where}: '{method}' is not a chain method of specgen's; synthetic acceptance replays "
            f"chain rounds: choose one of {', '.join(CHAIN_METHODS)} (or a variant such as chain/k2)"
        )
    try:
        data = json_value(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{where}: not a JSON file ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict) or data.get("schema") != BENCH_SCHEMA:
        raise ConfigError(f"{where}: not a `specgen bench --json` file (schema {BENCH_SCHEMA})")
    settings = data.get("settings") if isinstance(data.get("settings"), dict) else {}
    measurements = [m for m in data.get("measurements") or [] if isinstance(m, dict)]
    found = sorted({str(m.get("method")) for m in measurements if m.get("accepted_length_histogram")})
    k = _draft_tokens(method, settings, where)
    counts: Counter = Counter()
    try:
        for m in measurements:
            if m.get("method") == method:
                counts.update({int(a): int(n) for a, n in (m.get("accepted_length_histogram") or {}).items()})
    except (AttributeError, TypeError, ValueError):
        raise ConfigError(
            f"{where}: {method}'s accepted_length_histogram is not {{length: rounds}}"
        ) from None
    if not counts:
        raise ConfigError(
            f"{where}: no accepted lengths recorded for '{method}'; recorded: " + (", ".join(found) or "none")
        )
    lengths = tuple(sorted(a for a in counts if counts[a]))
    try:
        return Acceptance(
            AcceptanceMode.SYNTHETIC, lengths, tuple(counts[a] for a in lengths), k, seed, f"{path}:{method}"
        )
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _draft_tokens(method: str, settings: dict, where: str) -> int:
    """The k the recording drafted: a '/kN' variant's N, else the run's --draft-tokens; adaptive
    schedules drafted varying lengths and are refused."""
    suffixes = method.split("@", 1)[0].split("/")[1:]  # 'eagle/k2@HEAD': the head's path is no variant
    if any(s in ("additive", "expected-gain") for s in suffixes) or (
        not any(re.fullmatch(r"k\d+", s) for s in suffixes) and settings.get("schedule", "fixed") != "fixed"
    ):
        raise ConfigError(
            f"{where}: '{method}' drafted varying lengths (an adaptive schedule); record one with a fixed k"
        )
    for s in suffixes:
        if re.fullmatch(r"k\d+", s):
            return int(s[1:])
    k = settings.get("draft_tokens")
    if not isinstance(k, int) or k < 1:
        raise ConfigError(f"{where}: its settings do not say the draft length (draft_tokens)")
    return k


def draw(acceptance: Acceptance, index: int, position: int) -> int:
    """The recorded accepted length for the round of prompt `index` at `position` (committed
    tokens): a uniform from a hash of (seed, index, position), mapped through the histogram."""
    key = f"{acceptance.seed}:{index}:{position}".encode()
    u = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2.0**64
    cumulative = list(itertools.accumulate(acceptance.rounds))
    return acceptance.lengths[bisect_right(cumulative, u * cumulative[-1])]


def verdict(
    draft: torch.Tensor,
    logits: torch.Tensor,
    acceptance: Acceptance,
    index: int,
    position: int,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
) -> Verdict:
    """Accept the first min(draw, k) draft tokens; the target's own token follows them (argmax,
    or a draw from its warped law there). logits [k+1, V]: the verify forward's, root first."""
    accepted = min(draw(acceptance, index, position), draft.shape[0])
    if sampling.greedy:
        token = logits[accepted].argmax()
    else:
        token = sample(warp(logits[accepted], sampling), generator)
    # a fill on the device, not a copy from the host (which would wait for the verify forward)
    return Verdict.chain(
        torch.full((), accepted, dtype=torch.long, device=logits.device), token, draft.shape[0]
    )


def expected_accepted(acceptance: Acceptance, k: int) -> float:
    """Mean accepted tokens per full round of k drafted tokens: what a run should measure."""
    return sum(min(a, k) * n for a, n in zip(acceptance.lengths, acceptance.rounds)) / sum(acceptance.rounds)
