"""transformers' own speculative generation as reference columns for bench.

`generate(..., assistant_model=draft)` (default schedule, and num_assistant_tokens=4 with a
constant schedule) and prompt lookup, with the same stop ids, budget and sampling settings
as specgen's methods, counters paired from a forward hook and the streamer.
"""

from __future__ import annotations

import contextlib
import copy
import time
import warnings
from collections import Counter

import torch
from transformers.generation.streamers import BaseStreamer
from transformers.utils import logging as hf_logging

from specgen.bench.runners import Generation, Known, MethodSpec
from specgen.config import GenerationConfig, SamplingConfig
from specgen.decoding.stats import Stats
from specgen.errors import ConfigError


def _reference(
    name: str,
    description: str,
    assistant: bool,
    assistant_config: dict | None = None,
    generate_kwargs: dict | None = None,
) -> MethodSpec:
    """A transformers generation mode as a bench column (see HFRunner)."""
    return MethodSpec(
        name,
        assistant,
        lambda pair: HFRunner(pair, name, assistant, assistant_config, generate_kwargs),
        description,
    )


REFERENCES = (
    _reference("hf-assisted", "transformers assisted generation, the draft's default schedule", True),
    _reference(
        "hf-assisted-k4",
        "transformers assisted generation, num_assistant_tokens=4, constant schedule",
        True,
        {"num_assistant_tokens": 4, "num_assistant_tokens_schedule": "constant"},
    ),
    _reference(
        "hf-lookup",
        "transformers prompt lookup decoding, 10 tokens, no draft model",
        False,
        generate_kwargs={"prompt_lookup_num_tokens": 10},
    ),
)


class HFRunner:
    """`target.generate(...)` in one of transformers' speculative modes, with the same stop ids,
    sampling settings and token budget as specgen; counters come from a streamer and a hook.
    `assistant`: the pair's draft is the assistant_model, on a copy of its generation_config
    with `assistant_config` set; `generate_kwargs` go to generate() besides specgen's settings."""

    def __init__(
        self,
        pair,
        name: str,
        assistant: bool,
        assistant_config: dict | None = None,
        generate_kwargs: dict | None = None,
    ):
        self.pair, self.name, self.assistant = pair, name, assistant
        self.assistant_config, self.generate_kwargs = assistant_config or {}, generate_kwargs or {}
        if assistant and pair.draft is None:
            raise ConfigError(f"method {name} needs a draft model")

    def generate(self, prompt_ids: list[int], config: GenerationConfig) -> Generation:
        target = self.pair.target
        budget = min(config.max_new_tokens, target.context_length - len(prompt_ids))
        kwargs = hf_generate_kwargs(target, config.sampling, budget) | self.generate_kwargs
        if self.assistant:
            kwargs["assistant_model"] = self.pair.draft.model
        input_ids = torch.tensor([prompt_ids], device=target.device)
        probe = StepProbe(len(prompt_ids))
        hook = target.model.register_forward_pre_hook(probe.on_forward, with_kwargs=True)
        draft = self.pair.draft.model if self.assistant else None
        try:
            with (
                _assistant_config(draft, self.assistant_config),
                _seeded(config.sampling, target.device),
                _quiet_generate(),
            ):
                started = probe.started = time.perf_counter()
                output = target.model.generate(
                    input_ids, attention_mask=torch.ones_like(input_ids), streamer=probe, **kwargs
                )
                ids = output[0, len(prompt_ids) :].tolist()
                seconds = time.perf_counter() - started
        finally:
            hook.remove()
        return probe.generation(self.name, ids, seconds)

    def settings(self) -> dict:
        """What it runs with, transformers' defaults for the draft's unset values filled in."""
        values = dict(self.generate_kwargs)
        if self.assistant:
            config = self.pair.draft.model.generation_config
            # what transformers fills in for unset values (a private helper: tolerate its absence)
            defaults = getattr(config, "_get_default_generation_params", dict)()
            for key in (
                "num_assistant_tokens",
                "num_assistant_tokens_schedule",
                "assistant_confidence_threshold",
            ):
                value = getattr(config, key, None)
                values[key] = value if value is not None else defaults.get(key)
            values |= self.assistant_config
        return values


def hf_generate_kwargs(target, sampling: SamplingConfig, budget: int) -> dict:
    """generate() settings equal to specgen's: unset values would come from the model's own
    generation_config (Qwen ships repetition_penalty, top_k, ...), so neutralise them."""
    stop_ids = sorted(target.stop_ids)
    pad = target.tokenizer.pad_token_id
    kwargs = dict(
        max_new_tokens=budget,
        min_new_tokens=0,
        min_length=0,
        do_sample=not sampling.greedy,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        eos_token_id=stop_ids,
        pad_token_id=pad if pad is not None else (stop_ids[0] if stop_ids else None),
        return_dict_in_generate=False,
    )
    if not sampling.greedy:
        kwargs |= dict(
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            typical_p=1.0,
            epsilon_cutoff=0.0,
            eta_cutoff=0.0,
        )
        if getattr(target.model.generation_config, "min_p", None) is not None:
            kwargs["min_p"] = 0.0
    return kwargs


@contextlib.contextmanager
def _assistant_config(draft_model, overrides: dict):
    """The draft runs on a copy of its generation_config, restored afterwards: transformers
    writes the heuristic schedule's state back into it, which would leak between runs."""
    if draft_model is None:
        yield
        return
    original = draft_model.generation_config
    working = copy.deepcopy(original)
    for key, value in overrides.items():
        setattr(working, key, value)
    draft_model.generation_config = working
    try:
        yield
    finally:
        draft_model.generation_config = original


@contextlib.contextmanager
def _seeded(sampling: SamplingConfig, device: torch.device):
    """transformers samples from the global RNG: seed it inside a fork so ours is untouched."""
    if sampling.greedy or sampling.seed is None:
        yield
        return
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(sampling.seed)
        yield


@contextlib.contextmanager
def _quiet_generate():
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


class StepProbe(BaseStreamer):
    """Timestamps the first `put` after the prompt (TTFT) and pairs each decoding step's
    emitted tokens with the width of the target forward that produced them.

    In transformers' assisted loop each step is one target forward over [root, drafts]
    (the first over [prompt, drafts]) followed by one `put` of the kept tokens, so
    drafted = width - 1 (width - prompt length on the first step) and accepted = kept - 1.
    If the steps and forwards do not pair up, the counters are left unknown.
    """

    def __init__(self, prompt_length: int):
        self.prompt_length = prompt_length
        self.started = 0.0
        self.first_at: float | None = None
        self.emitted: list[int] = []
        self.widths: list[int] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate() first puts the prompt itself
            self._prompt_seen = True
            return
        if self.first_at is None:
            self.first_at = time.perf_counter()
        self.emitted.append(int(value.numel()))

    def end(self) -> None:
        pass

    def on_forward(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.widths.append(int(ids.shape[-1]) if ids is not None else -1)

    def generation(self, name: str, ids: list[int], seconds: float) -> Generation:
        ttft = self.first_at - self.started if self.first_at is not None else None
        stats = Stats(method=name, new_tokens=len(ids), seconds=seconds, time_to_first_token=ttft)
        result = Generation(ids, seconds, ttft, self.emitted[0] if self.emitted else 0, stats)
        if len(self.widths) != len(self.emitted) or not self.widths:
            return result
        histogram: Counter = Counter()
        for step, (width, kept) in enumerate(zip(self.widths, self.emitted)):
            proposed = width - (self.prompt_length if step == 0 else 1)
            if proposed < 0 or not 1 <= kept <= proposed + 1:
                return result
            if proposed:
                stats.drafted += proposed
                stats.accepted += kept - 1
                histogram[kept - 1] += 1
        stats.rounds, stats.accepted_lengths = len(self.widths), histogram
        result.known = Known.FORWARDS | Known.DRAFTS
        return result


def assistant_settings(runners: list) -> dict:
    """What each reference column among `runners` ran with (in REFERENCES' order), so the JSON
    says exactly what was compared."""
    built = {r.name: r for r in runners if isinstance(r, HFRunner)}
    return {spec.name: built[spec.name].settings() for spec in REFERENCES if spec.name in built}
