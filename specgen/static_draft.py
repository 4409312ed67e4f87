"""Chain drafting with a fixed-size StaticCache, and on CUDA a compiled single-token step.

The draft's hot path is k single-token forwards per round. On a GPU each is a few dozen small
kernels whose launch latency dominates; with a StaticCache every step has the same shapes and
the same tensor addresses, so `torch.compile(mode="reduce-overhead")` can capture it as a CUDA
graph and replay it with one launch. On the CPU the static cache alone is used (compiling
there is not worth its start-up time).

Cache bookkeeping: a StaticCache cannot be cropped, and need not be. `_written` counts the
positions whose KV are meaningful (the committed prefix plus the drafts fed this round);
"cropping" lowers it and moves each layer's in-place write counter back (`_seek`), and the
next forward overwrites from there. A fixed-width 2D mask
hides every entry past what the forward writes, and the causal mask built from
`cache_position` the rest, so stale drafts are never attended to. Everything else (the proposal, the reported distributions, `observe`) is
ModelDrafter's, so the acceptance rules see exactly the same contract.
"""

from __future__ import annotations

import torch

from specgen.drafters import ModelDrafter


class StaticModelDrafter(ModelDrafter):
    def __init__(self, model, device: torch.device, vocab: int | None = None, confidence=None,
                 max_length: int | None = None, compile: bool | None = None):
        super().__init__(model, device, vocab, confidence)
        from transformers import StaticCache

        config = model.config
        self.max_length = max_length or int(getattr(config, "max_position_embeddings", 0) or 4096)
        self.cache = StaticCache(config=config, max_cache_len=self.max_length)
        self._written = 0
        compile = device.type == "cuda" if compile is None else compile
        self._step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) if compile else model.forward
        self.compiled = compile

    def rewind(self, valid: int) -> None:
        self.cached = min(self.cached, valid)
        self._seek(self.cached)

    def reset_to(self, ids: list[int]) -> None:
        self.cached = min(self.cached, len(ids))
        self._seek(self.cached)
        if len(ids) > self.cached:
            self._forward(ids[self.cached:])
            self.cached = len(ids)

    def observe(self, kept: int) -> None:
        self.cached = self._base + min(kept, self._fed)
        self._seek(self.cached)

    def _seek(self, length: int) -> None:
        """The next write goes to position `length` (each layer counts its writes in place)."""
        if length != self._written:
            for layer in self.cache.layers:
                if getattr(layer, "is_initialized", False):
                    layer.cumulative_length.fill_(length)
        self._written = length

    def _forward_tensor(self, input_ids: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[1]
        if self._written + n > self.max_length:
            raise ValueError(f"the draft's static cache holds {self.max_length} positions")
        positions = torch.arange(self._written, self._written + n, device=self.device)
        # keys past what this forward writes hold stale drafts (or zeros): mask them out; the mask
        # has the cache's fixed width, so the compiled step sees the same shapes every call
        mask = (torch.arange(self.max_length, device=self.device) < self._written + n).long().unsqueeze(0)
        forward = self._step if n == 1 else self.model.forward
        out = forward(input_ids=input_ids, past_key_values=self.cache, use_cache=True, cache_position=positions,
                      position_ids=positions.unsqueeze(0), attention_mask=mask, logits_to_keep=1)
        self._written += n
        return out.logits
