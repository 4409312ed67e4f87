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

llama.cpp runs in a child process per column (isolated.py): a crash there is that column's
one-line result, and every other column is measured and written.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
from pathlib import Path

import torch

from specgen.bench.isolated import IsolatedRunner
from specgen.bench.runners import Generation, Known
from specgen.config import GenerationConfig
from specgen.decoding.stats import Stats
from specgen.errors import ConfigError
from specgen.models import catalog

METHODS = {
    "llamacpp": "llama.cpp plain decoding of the target's GGUF file (llama-cpp-python)",
    "llamacpp-lookup": "llama.cpp prompt-lookup decoding, 10 tokens, same GGUF (llama-cpp-python)",
}
HINT = "pip install 'specgen[llamacpp]' (builds llama.cpp with this machine's compilers)"
CRASH_HINT = " - see README 'llama.cpp on CPUs with AMX'"


def installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def require() -> None:
    if not installed():
        raise ConfigError(f"the llamacpp methods need llama-cpp-python: {HINT}")


def refuse_early(names: list[str], target: str) -> None:
    """Before a model loads, a llama.cpp column's needs in order: a GGUF target (a catalog name or
    a file), then llama-cpp-python. The target is asked first, so a target of no GGUF is refused
    in the same words whether or not the package is installed."""
    asked = [n for n in names if n in METHODS]
    if not asked:
        return
    path = Path(target).expanduser()
    if target not in catalog.CATALOG and not path.is_file():
        raise ConfigError(
            f"{asked[0]} (llama.cpp) needs a GGUF target (a catalog model or a .gguf file); "
            f"{target} is not one",
            hint="leave it out of --methods",
        )
    require()


class LlamaCppRunner(IsolatedRunner):
    """llama.cpp on the target's GGUF, in a child process of its own (isolated.py): a build that
    crashes (SIGSEGV in its batched prompt decode on CPUs with AMX) ends this column with one
    line, not the bench run. The child loads the file once and serves every prompt of the run."""

    def __init__(self, pair, name: str):
        require()
        target = pair.target
        gguf = target.gguf_file() if getattr(target, "gguf", None) else None  # fetched again if let go
        if not gguf:
            raise ConfigError(
                f"method {name} needs a GGUF target (a catalog model or a .gguf file); "
                f"{target.name} was loaded from {target.source}"
            )
        n_ctx = min(target.context_length, 4096)
        super().__init__(
            name,
            LlamaCppGenerator,
            (str(gguf), name, n_ctx, tuple(int(t) for t in target.stop_ids)),
            label="llama.cpp",
            crash_hint=CRASH_HINT,
        )


class LlamaCppGenerator:
    """The child's side: one llama.cpp context on the GGUF, with the child's torch thread count
    (the parent's, set by isolated.serve) for llama.cpp's threads."""

    def __init__(self, gguf: str, name: str, n_ctx: int, stop_ids: tuple[int, ...]):
        from llama_cpp import Llama  # the optional extra: imported only where its columns run

        self.name, self.stops = name, set(stop_ids)
        self.lookup = name == "llamacpp-lookup"
        threads = torch.get_num_threads()
        draft = None
        if self.lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # the optional extra

            draft = LlamaPromptLookupDecoding(num_pred_tokens=10)
        with _quiet_stderr():
            self.llm = Llama(
                model_path=gguf,
                n_ctx=n_ctx,
                n_threads=threads,
                n_threads_batch=threads,
                draft_model=draft,
                verbose=False,
                seed=0,
            )

    def generate(self, prompt_ids: list[int], config: GenerationConfig) -> Generation:
        llm = self.llm
        sampling = config.sampling
        budget = min(config.max_new_tokens, llm.n_ctx() - len(prompt_ids) - 1)
        if budget < 1:
            raise ConfigError(f"the prompt ({len(prompt_ids)} tokens) leaves no room in llama.cpp's context")
        greedy = sampling.greedy
        llm.reset()  # no KV reuse from the previous prompt: every method starts cold
        if not greedy and sampling.seed is not None:
            llm.set_seed(int(sampling.seed))
        kwargs = (
            dict(temp=0.0, top_k=1, top_p=1.0, min_p=0.0)
            if greedy
            else dict(temp=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p, min_p=0.0)
        )
        ids: list[int] = []
        stop = "length"
        started = time.perf_counter()
        first_at = None
        for token in llm.generate(prompt_ids, repeat_penalty=1.0, reset=True, **kwargs):
            if first_at is None:
                first_at = time.perf_counter()
            token = int(token)
            if token in self.stops:
                stop = "eos"
                break
            ids.append(token)
            if len(ids) >= budget:
                break
        seconds = time.perf_counter() - started
        ttft = first_at - started if first_at is not None else None
        stats = Stats(
            method=self.name,
            new_tokens=len(ids),
            seconds=seconds,
            time_to_first_token=ttft,
            stop=stop,
            rounds=len(ids) + (stop == "eos"),
        )  # plain decoding: one forward per token
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
