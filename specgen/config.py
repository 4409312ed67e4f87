"""Frozen settings objects, validated once, so the engine never checks options again."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from specgen.errors import ConfigError


class Method(str, enum.Enum):
    """Decoding methods the engine can run; plain decoding is the baseline."""

    PLAIN = "plain"
    CHAIN = "chain"

    @classmethod
    def parse(cls, value: str) -> "Method":
        try:
            return cls(value.strip().lower())
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ConfigError(f"unknown method '{value}'; choose one of: {names}") from None

    @property
    def needs_draft_model(self) -> bool:
        return self is Method.CHAIN


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GenerationConfig:
    """One generation: method, draft length and stop conditions."""

    method: Method = Method.CHAIN
    max_new_tokens: int = 256
    draft_tokens: int = 4
    sampling: SamplingConfig = SamplingConfig()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.draft_tokens < 1:
            raise ConfigError(f"--draft-tokens must be >= 1, got {self.draft_tokens}")
        if self.draft_tokens > 64:
            raise ConfigError(f"--draft-tokens must be <= 64, got {self.draft_tokens}")
