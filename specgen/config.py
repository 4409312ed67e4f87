"""Frozen settings objects, validated once, so the engine never checks options again."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from specgen.errors import ConfigError


@dataclass(frozen=True)
class ModelSettings:
    """What to load: the pair, its placement and weight formats (run, chat, bench and serve)."""

    target: str
    draft: str | None
    device: str = "auto"
    draft_device: str | None = None
    dtype: str = "auto"
    draft_quant: str | None = None  # runtime/quant.py: auto, none, int8, int8-wo, prune, int8+prune
    compile: str = "auto"  # runtime/compiled.py: auto (inductor on CUDA), on, off, graphs, inductor
    target_quant: str = "none"  # runtime/quant.py: auto, none, int8


class Schedule(str, enum.Enum):
    """How many tokens to draft each round (decoding/length.py): a fixed k, or adaptive up to k."""

    FIXED = "fixed"
    ADDITIVE = "additive"
    EXPECTED_GAIN = "expected-gain"


class Method(str, enum.Enum):
    """Decoding methods the engine can run; plain decoding is the baseline."""

    PLAIN = "plain"
    CHAIN = "chain"
    RSD_C = "rsd-c"
    RSD_S = "rsd-s"
    MULTI_DRAFT = "multi-draft"
    LOOKUP = "lookup"  # prompt lookup: n-gram continuations, no draft model
    LOOKUP_CHAIN = "lookup-chain"  # prompt lookup when the tail matches well, the draft model otherwise

    @classmethod
    def parse(cls, value: str) -> "Method":
        try:
            return cls(value.strip().lower())
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ConfigError(f"unknown method '{value}'; choose one of: {names}") from None

    @property
    def needs_draft_model(self) -> bool:
        return self not in (Method.PLAIN, Method.LOOKUP)

    @property
    def is_tree(self) -> bool:
        return self in (Method.RSD_C, Method.RSD_S, Method.MULTI_DRAFT)


SEED_MAX = 2**63 - 1  # batched rows seed with seed + row index, which must stay below 2**64


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k
    top_p: float = 1.0  # 1.0: no nucleus cut
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ConfigError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed <= SEED_MAX:  # torch generators take 64 bits
            raise ConfigError(f"--seed must be in 0..{SEED_MAX}, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


LOOKUP_TOKENS = 4  # lookup-chain: tokens a lookup round may propose (the lookup method's default k)


@dataclass(frozen=True)
class GenerationConfig:
    """One generation: method, draft length and stop conditions."""

    method: Method = Method.CHAIN
    max_new_tokens: int = 256
    draft_tokens: int = 4
    sampling: SamplingConfig = SamplingConfig()  # every row's, unless a request brings its own
    branching: tuple[int, ...] = (2, 2, 1)  # rsd-c and multi-draft: children per depth
    beam_width: int = 3  # rsd-s
    depth: int = 4  # rsd-s
    schedule: Schedule = Schedule.FIXED  # chain/lookup draft length: fixed k, or adaptive up to k
    draft_confidence: float = 0.0  # chain: stop drafting when the draft's top probability is below
    deterministic: bool = False  # replay every window at a fixed shape (replay.py)
    verify_window: int = 32
    device_draft_tokens: bool = False  # draft_tokens is a placeholder: decoding/length.choose sets it
    device_confidence: bool = False  # no --draft-confidence given: a device-chosen k brings its stop

    @property
    def round_tokens(self) -> int:
        """Most tokens one round proposes: draft_tokens; lookup-chain's lookup rounds may propose
        up to LOOKUP_TOKENS (they cost no draft forward, and verifying a few more tokens costs
        little) while its model rounds keep draft_tokens."""
        if self.method is Method.LOOKUP_CHAIN and self.schedule is Schedule.FIXED:
            return max(self.draft_tokens, LOOKUP_TOKENS)
        return self.draft_tokens

    @property
    def tree_depth(self) -> int:
        return self.depth if self.method is Method.RSD_S else len(self.branching)

    @property
    def tree_budget(self) -> int:
        """Draft nodes scored per target forward (the root excluded)."""
        if self.method is Method.RSD_S:
            return self.beam_width * self.depth
        if self.method.is_tree:
            total, width = 0, 1
            for b in self.branching:
                width *= b
                total += width
            return total
        return self.draft_tokens

    def __post_init__(self) -> None:
        if not 0.0 <= self.draft_confidence < 1.0:
            raise ConfigError(f"--draft-confidence must be in [0, 1), got {self.draft_confidence}")
        if not 2 <= self.verify_window <= 512:
            raise ConfigError(f"--verify-window must be in 2..512, got {self.verify_window}")
        if self.deterministic and self.sampling.seed is None and not self.sampling.greedy:
            object.__setattr__(self, "sampling", SamplingConfig(
                self.sampling.temperature, self.sampling.top_k, self.sampling.top_p, 0))
        if not self.branching or any(b < 1 for b in self.branching) or len(self.branching) > 16:
            raise ConfigError(f"--branching needs 1 to 16 factors >= 1, got {','.join(map(str, self.branching))}")
        if not 1 <= self.beam_width <= 64 or not 1 <= self.depth <= 16:
            raise ConfigError(f"--beam-width must be in 1..64 and --depth in 1..16, got "
                              f"{self.beam_width} and {self.depth}")
        if self.method.is_tree and self.tree_budget > 256:
            raise ConfigError(f"the draft tree would have {self.tree_budget} nodes; keep it at most 256")
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.draft_tokens < 1:
            raise ConfigError(f"--draft-tokens must be >= 1, got {self.draft_tokens}")
        if self.draft_tokens > 64:
            raise ConfigError(f"--draft-tokens must be <= 64, got {self.draft_tokens}")


def parse_branching(value: str) -> tuple[int, ...]:
    """'2,2,1' -> (2, 2, 1), with a clear error for anything else."""
    try:
        factors = tuple(int(part) for part in value.replace(" ", "").split(",") if part)
    except ValueError:
        raise ConfigError(f"--branching takes comma-separated integers like 2,2,1, got '{value}'") from None
    if not factors:
        raise ConfigError("--branching needs at least one factor, like 2,2,1")
    return factors


def parse_draft_tokens(value: str) -> tuple[int, Schedule | None]:
    """'4' -> (4, None); 'auto' -> (8, the adaptive schedule); 'device' -> (4, None), a
    placeholder that decoding/build.py replaces by the k measured for the device.

    The adaptive schedule is expected-gain, the better of the two in bench's schedule
    comparison (benchmarks/README.md).
    """
    value = str(value).strip().lower()
    if value == "device":
        return 4, None
    if value == "auto":
        return 8, Schedule.EXPECTED_GAIN
    try:
        return int(value), None
    except ValueError:
        raise ConfigError(f"--draft-tokens takes a number, 'auto' or 'device', got '{value}'") from None
