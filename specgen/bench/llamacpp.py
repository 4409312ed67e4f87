"""llama.cpp as reference columns for bench, through llama-cpp-python (`specgen[llamacpp]`).

* `llamacpp`: plain decoding of the target's own GGUF file by llama.cpp (its quantized
  kernels: Q4_K/Q6_K for the default target), the CPU reference people already use.
* `llamacpp-lookup`: the same with llama-cpp-python's prompt-lookup decoding
  (`LlamaPromptLookupDecoding`, 10 tokens per guess), llama.cpp's draft-free speculation.

Both are fed the token ids specgen encoded (the GGUF carries the same vocabulary), stop at the
same stop ids and budget, and decode greedily or with the same temperature / top-k / top-p
and seed. llama.cpp computes with its own quantized weights, so its text can differ from
specgen's plain decoding of the dequantized model: bench's identical column shows by how much.
Acceptance counters are not exposed by llama-cpp-python, so those cells stay empty.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time

import torch

from specgen.bench.runners import Generation, Known
from specgen.config import GenerationConfig
from specgen.decoding.stats import Stats
from specgen.errors import ConfigError

METHODS = {
    "llamacpp": "llama.cpp plain decoding of the target's GGUF file (llama-cpp-python)",
    "llamacpp-lookup": "llama.cpp prompt-lookup decoding, 10 tokens, same GGUF (llama-cpp-python)",
}
HINT = "pip install 'specgen[llamacpp]' (builds llama.cpp with this machine's compilers)"


def installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def require() -> None:
    if not installed():
        raise ConfigError(f"the llamacpp methods need llama-cpp-python: {HINT}")


class LlamaCppRunner:
    """One llama.cpp context on the target's GGUF, shared by the generations of one bench run."""

    _shared: dict = {}  # (gguf, lookup, n_ctx, threads) -> Llama: load the file once per process

    def __init__(self, pair, name: str):
        require()
        self.pair, self.name = pair, name
        self.lookup = name == "llamacpp-lookup"
        gguf = getattr(pair.target, "gguf", None)
        if not gguf:
            raise ConfigError(f"method {name} needs a GGUF target (a catalog model or a .gguf file); "
                              f"{pair.target.name} was loaded from {pair.target.source}")
        self.gguf = gguf

    def _llama(self):
        from llama_cpp import Llama  # the optional extra: imported only when its columns run

        threads = torch.get_num_threads()
        n_ctx = min(self.pair.target.context_length, 4096)
        key = (self.gguf, self.lookup, n_ctx, threads)
        if key not in self._shared:
            draft = None
            if self.lookup:
                from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # the optional extra

                draft = LlamaPromptLookupDecoding(num_pred_tokens=10)
            with _quiet_stderr():
                self._shared[key] = Llama(model_path=self.gguf, n_ctx=n_ctx, n_threads=threads,
                                          n_threads_batch=threads, draft_model=draft, verbose=False, seed=0)
        return self._shared[key]

    def generate(self, prompt_ids: list[int], config: GenerationConfig) -> Generation:
        llm = self._llama()
        sampling = config.sampling
        target = self.pair.target
        budget = min(config.max_new_tokens, llm.n_ctx() - len(prompt_ids) - 1)
        if budget < 1:
            raise ConfigError(f"the prompt ({len(prompt_ids)} tokens) leaves no room in llama.cpp's context")
        stops = set(target.stop_ids)
        greedy = sampling.greedy
        llm.reset()  # no KV reuse from the previous prompt: every method starts cold
        if not greedy and sampling.seed is not None:
            llm.set_seed(int(sampling.seed))
        kwargs = dict(temp=0.0, top_k=1, top_p=1.0, min_p=0.0) if greedy else dict(
            temp=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p, min_p=0.0)
        ids: list[int] = []
        stop = "length"
        started = time.perf_counter()
        first_at = None
        for token in llm.generate(prompt_ids, repeat_penalty=1.0, reset=True, **kwargs):
            if first_at is None:
                first_at = time.perf_counter()
            token = int(token)
            if token in stops:
                stop = "eos"
                break
            ids.append(token)
            if len(ids) >= budget:
                break
        seconds = time.perf_counter() - started
        ttft = first_at - started if first_at is not None else None
        stats = Stats(method=self.name, new_tokens=len(ids), seconds=seconds, time_to_first_token=ttft, stop=stop,
                      rounds=len(ids) + (stop == "eos"))  # plain decoding: one forward per token
        return Generation(ids, seconds, ttft, 1, stats, Known.NONE if self.lookup else Known.FORWARDS)


@contextlib.contextmanager
def _quiet_stderr():
    """llama.cpp prints its load log to fd 2 even with verbose=False on some builds."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
