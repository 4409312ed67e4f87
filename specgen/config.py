"""Frozen settings objects, validated once, so the engine never checks options again."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from specgen.errors import ConfigError


class Scope(str, enum.Enum):
    """Who shares one suffix memory (runtime/memories.py): the clients of one API key, every
    client, or nobody (a memory per request)."""

    KEY = "key"
    SHARED = "shared"
    REQUEST = "request"


# the smallest --suffix-cache a memory can be built in (runtime/suffix.py needs 17,152 bytes
# with its default depth; tested): a smaller one is refused here, in one line
MIN_SUFFIX_MIB = 0.02


@dataclass(frozen=True)
class MemorySettings:
    """The suffix memory of earlier requests' text (runtime/memories.py): its size in MiB, the
    file it is kept in across starts, who shares one (a server's clients)."""

    suffix_cache: float = 256.0
    suffix_cache_file: str | None = None
    suffix_scope: Scope = Scope.KEY

    def __post_init__(self) -> None:
        mib = self.suffix_cache
        if not (isinstance(mib, (int, float)) and MIN_SUFFIX_MIB <= mib < float("inf")):
            raise ConfigError(f"--suffix-cache must be a number of MiB, at least {MIN_SUFFIX_MIB}, got {mib}")
        if not isinstance(self.suffix_scope, Scope):
            try:
                object.__setattr__(self, "suffix_scope", Scope(str(self.suffix_scope).strip().lower()))
            except ValueError:
                names = ", ".join(s.value for s in Scope)
                raise ConfigError(
                    f"--suffix-scope must be one of {names}, got '{self.suffix_scope}'"
                ) from None

    @property
    def budget(self) -> int:
        """The memories' bytes together."""
        return int(self.suffix_cache * (1 << 20))


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
    threads: int | None = (
        None  # torch threads of the forwards (runtime/threads.py); None: fitted to the free cores
    )
    memory: MemorySettings = MemorySettings()  # the target's suffix memory (runtime/memories.py)


MAX_DRAFT_TOKENS = 64  # the most tokens a round may draft (--draft-tokens)


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
    EAGLE = "eagle"  # chains from an EAGLE-3 head on the target's own features (--draft HEAD_DIR)
    SUFFIX = "suffix"  # continuations from the memory of earlier requests' text, no draft model

    @classmethod
    def parse(cls, value: str) -> "Method":
        try:
            return cls(value.strip().lower())
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ConfigError(f"unknown method '{value}'; choose one of: {names}") from None

    @property
    def needs_draft_model(self) -> bool:
        return self not in (Method.PLAIN, Method.LOOKUP, Method.SUFFIX)

    @property
    def is_tree(self) -> bool:
        return self in (Method.RSD_C, Method.RSD_S, Method.MULTI_DRAFT)

    @property
    def options(self) -> frozenset[str]:
        """The drafting options this method reads (GenerationConfig's names): chains take a
        draft length and its schedule (a model's or a head's chains a confidence stop too), trees a
        shape whatever the draft length, and a confidence stop on their depth, plain none."""
        length = frozenset({"draft_tokens", "schedule"})
        return {
            Method.PLAIN: frozenset(),
            Method.LOOKUP: length,
            Method.SUFFIX: length,
            Method.EAGLE: length | {"draft_confidence"},
            Method.CHAIN: length | {"draft_confidence"},
            Method.LOOKUP_CHAIN: length | {"draft_confidence"},
            Method.RSD_C: frozenset({"branching", "draft_confidence"}),
            Method.MULTI_DRAFT: frozenset({"branching", "draft_confidence"}),
            Method.RSD_S: frozenset({"beam_width", "depth", "draft_confidence"}),
        }[self]


# what run, chat and bench decode with, and what a served request gets, unless told otherwise:
# the drafting method of the best mean speed-up on every CPU measured (lookup rounds where the text
# repeats, the draft model elsewhere; benchmarks/floor.md, "Which method is the default")
DEFAULT_METHOD = Method.LOOKUP_CHAIN


SEED_MAX = 2**63 - 1  # batched rows seed with seed + row index, which must stay below 2**64
MAX_LOGPROBS = 20  # alternatives reported per token at most (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen. temperature 0 means greedy (argmax). `logprobs`: report each
    committed token's log-probability under the target and the `logprobs` most likely tokens at
    its position (None: nothing reported), as OpenAI's and vLLM's sampling parameters do."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k
    top_p: float = 1.0  # 1.0: no nucleus cut
    seed: int | None = None
    logprobs: int | None = None  # 0..MAX_LOGPROBS alternatives per token

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < float("inf"):  # NaN fails too; inf would be uniform noise
            raise ConfigError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed <= SEED_MAX:  # torch generators take 64 bits
            raise ConfigError(f"--seed must be in 0..{SEED_MAX}, got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ConfigError(f"--logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class AcceptanceMode(str, enum.Enum):
    """Where a round's accepted length comes from. REAL: the acceptance rule (every command).
    SYNTHETIC: replayed from a recording of a real pair's rounds (decoding/synthetic.py), so a
    benchmark on random weights, which accept nothing, still runs rounds of realistic lengths;
    its tokens are then not the target's. Only benchmark scripts set it."""

    REAL = "real"
    SYNTHETIC = "synthetic"


@dataclass(frozen=True)
class Acceptance:
    """The acceptance mode and, when SYNTHETIC, the recorded accepted-length distribution
    (`synthetic.load` reads one from a bench JSON). Draws are keyed by (seed, prompt index,
    position), so a rerun replays the same rounds."""

    mode: AcceptanceMode = AcceptanceMode.REAL
    lengths: tuple[int, ...] = ()  # recorded accepted lengths, ascending
    rounds: tuple[int, ...] = ()  # how many recorded rounds accepted each length
    draft_tokens: int = 0  # the k the recording drafted: a round here may draft no more
    seed: int = 0
    source: str = ""  # where the recording came from (reports)

    def __post_init__(self) -> None:
        if self.mode is AcceptanceMode.REAL:
            if self.lengths or self.rounds:
                raise ConfigError("real acceptance takes no recording")
            return
        if (
            not self.lengths
            or len(self.lengths) != len(self.rounds)
            or any(n < 0 for n in self.rounds)
            or not sum(self.rounds)
        ):
            raise ConfigError(
                f"synthetic acceptance needs a non-empty histogram of rounds, got {self.source or 'none'}"
            )
        if (
            list(self.lengths) != sorted(set(self.lengths))
            or self.lengths[0] < 0
            or self.lengths[-1] > self.draft_tokens
        ):
            raise ConfigError(
                f"synthetic acceptance: accepted lengths {list(self.lengths)} must be distinct, "
                f"ascending and in 0..{self.draft_tokens} (the recording's draft length)"
            )

    @property
    def synthetic(self) -> bool:
        return self.mode is AcceptanceMode.SYNTHETIC


LOOKUP_TOKENS = 4  # lookup-chain: tokens a lookup round may propose (the lookup method's default k)
SUFFIX_TOKENS = 32  # suffix: the most a round drafts when the memory's counts support it (k by default)


@dataclass(frozen=True)
class GenerationConfig:
    """One generation: method, draft length and stop conditions."""

    method: Method = DEFAULT_METHOD
    max_new_tokens: int = 256
    draft_tokens: int = 4
    sampling: SamplingConfig = SamplingConfig()  # every row's, unless a request brings its own
    branching: tuple[int, ...] = (2, 2, 1)  # rsd-c and multi-draft: children per depth
    beam_width: int = 3  # rsd-s
    depth: int = 4  # rsd-s
    schedule: Schedule = Schedule.FIXED  # chain/lookup draft length: fixed k, or adaptive up to k
    # chain: stop drafting when the product of the draft's top probabilities falls below this
    draft_confidence: float = 0.0
    deterministic: bool = False  # replay every window at a fixed shape (replay.py)
    verify_window: int = 32
    device_draft_tokens: bool = False  # draft_tokens is a placeholder: decoding/costs.choose sets it
    device_confidence: bool = False  # no --draft-confidence given: a device-chosen k brings its stop
    # rows lower their draft length where drafting does not pay (decoding/floor.py): where k is the
    # device's choice or adaptive; never where the user (or a request) fixed it, which then means k
    floor: bool = False
    acceptance: Acceptance = Acceptance()  # REAL everywhere but benchmark scripts (AcceptanceMode)
    # whose suffix memory the row drafts from and writes to (runtime/memories.py): "" the process's
    # own requests; a server's client by a digest of its API key
    tenant: str = ""

    @property
    def seeded(self) -> bool:
        """A seeded sampled generation outside deterministic mode: the same seed must give the same
        text again, so what other requests wrote (a suffix memory) may not change its drafts."""
        return not self.sampling.greedy and self.sampling.seed is not None and not self.deterministic

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
    def tree_levels(self) -> tuple[int, ...]:
        """A tree method's whole tree: its draft nodes at each depth (the root excluded)."""
        if self.method is Method.RSD_S:
            return (self.beam_width,) * self.depth
        levels, width = [], 1
        for b in self.branching:
            width *= b
            levels.append(width)
        return tuple(levels)

    @property
    def tree_budget(self) -> int:
        """Draft nodes scored per target forward (the root excluded)."""
        return sum(self.tree_levels) if self.method.is_tree else self.draft_tokens

    def __post_init__(self) -> None:
        if not 0.0 <= self.draft_confidence < 1.0:
            raise ConfigError(f"--draft-confidence must be in [0, 1), got {self.draft_confidence}")
        if not 2 <= self.verify_window <= 512:
            raise ConfigError(f"--verify-window must be in 2..512, got {self.verify_window}")
        if self.deterministic and self.sampling.seed is None and not self.sampling.greedy:
            object.__setattr__(self, "sampling", dataclasses.replace(self.sampling, seed=0))
        if self.deterministic and self.sampling.logprobs is not None:
            raise ConfigError(
                "logprobs are not reported in deterministic mode (a replay may replace the "
                "tokens they would describe)"
            )
        if not self.branching or any(b < 1 for b in self.branching) or len(self.branching) > 16:
            raise ConfigError(
                f"--branching needs 1 to 16 factors >= 1, got {','.join(map(str, self.branching))}"
            )
        if not 1 <= self.beam_width <= 64:
            raise ConfigError(f"--beam-width must be in 1..64, got {self.beam_width}")
        if not 1 <= self.depth <= 16:
            raise ConfigError(f"--depth must be in 1..16, got {self.depth}")
        if self.deterministic and self.method.is_tree and self.verify_window <= self.tree_depth:
            raise ConfigError(
                f"--verify-window {self.verify_window} leaves no room for a tree {self.tree_depth} deep "
                f"({self.method.value} would never draft); give at least {self.tree_depth + 1}"
            )
        if self.method.is_tree and self.tree_budget > 256:
            shape = "--beam-width times --depth" if self.method is Method.RSD_S else "--branching"
            raise ConfigError(
                f"the draft tree of this {shape} would have {self.tree_budget} nodes; keep it at most 256"
            )
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.draft_tokens < 1:
            raise ConfigError(f"--draft-tokens must be >= 1, got {self.draft_tokens}")
        if self.draft_tokens > MAX_DRAFT_TOKENS:
            raise ConfigError(f"--draft-tokens must be <= {MAX_DRAFT_TOKENS}, got {self.draft_tokens}")
        if self.acceptance.synthetic:
            self._check_synthetic()

    def _check_synthetic(self) -> None:
        """Synthetic acceptance replays chain rounds at most as long as the recording's."""
        if self.method.is_tree:
            raise ConfigError(
                f"synthetic acceptance replays chain rounds; {self.method.value} drafts trees: "
                "use chain, lookup or lookup-chain"
            )
        if self.deterministic:
            raise ConfigError(
                "synthetic acceptance emits tokens that are not the target's: a deterministic "
                "replay would roll them back; turn --deterministic off"
            )
        if self.method is not Method.PLAIN and self.round_tokens > self.acceptance.draft_tokens:
            raise ConfigError(
                f"synthetic acceptance recorded at k={self.acceptance.draft_tokens} cannot drive "
                f"k={self.round_tokens}: a longer round could accept more than the recording shows"
            )


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
    comparison (benchmarks/quantization.md).
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
