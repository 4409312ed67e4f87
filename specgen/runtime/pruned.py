"""A draft's pruned output layer and weight-only int8 linears (`--draft-quant prune`, `int8-wo`).

* `PrunedHead`: the output layer keeps the first `keep` token ids (byte-level BPE ids are in
  merge order, so low ids are the frequent pieces), the special tokens, and every token the
  draft has read: ids in the prompt or in the committed text join the kept set the first time
  the draft's embedding sees them (a prompt's identifiers, a code fence), computed from the
  original head rows. Every other logit is -inf, so the draft never proposes those ids and the
  distribution it reports (softmax over the kept ids, exact zeros elsewhere) is exactly the one
  it samples from. Speculative sampling stays lossless; only the acceptance rate can change.
  Text that mostly lives outside the first ids (Chinese, Japanese and Korean pieces sit above
  id 98304 in Qwen's vocabulary) makes the head widen back to every id, once: when more than a
  quarter of the last 128 ids the draft read were outside the static set.
* `Int8WeightOnlyLinear`: int8 weights per output channel, activations in their own dtype,
  through torch's `_weight_int8pack_mm` CPU kernel.

Both keep the model's forward signature and a full-width logits tensor, so every drafter
(chain, trees, batches) works unchanged. runtime/quant.py parses and applies the option.
"""

from __future__ import annotations

import collections

import torch
from torch import nn

from specgen.errors import ConfigError
from specgen.runtime import int8

DEFAULT_KEEP = 32768
WIDEN_WINDOW, WIDEN_MIN, WIDEN_SHARE = 128, 64, 0.25  # see PrunedHead.see


# -- pruned output layer ------------------------------------------------------------------------
class PrunedHead(nn.Module):
    """logits[..., ids] = x @ W[ids]^T for the kept ids; every other logit is -inf (never proposed).

    The static ids (the first `keep` and the specials) live in an inner nn.Linear, so the int8
    variants quantize it like any layer. `see(input_ids)` (called by a pre-hook on the model's
    input embedding, so every forward path and drafter gets it) adds the ids the draft reads
    that are not kept yet; their rows, taken from the original head weight (the input
    embedding itself when they are tied, so no extra memory), form a small fp32 product that
    grows with the text.
    """

    def __init__(self, head: nn.Linear, ids: torch.Tensor):
        super().__init__()
        self.vocab, self.in_features = head.out_features, head.in_features
        self.out_features = self.vocab
        self.register_buffer("ids", ids, persistent=False)
        self.linear = nn.Linear(
            head.in_features,
            len(ids),
            bias=head.bias is not None,
            dtype=head.weight.dtype,
            device=head.weight.device,
        )
        with torch.no_grad():
            self.linear.weight.copy_(head.weight.index_select(0, ids))
            if head.bias is not None:
                self.linear.bias.copy_(head.bias[ids])
        self.linear.requires_grad_(False)
        self._rows = head.weight.detach()  # the full head's rows, for ids read later (not a parameter)
        self._row_bias = None if head.bias is None else head.bias.detach()
        self.known = torch.zeros(self.vocab, dtype=torch.bool, device=ids.device)
        self.known[ids] = True
        self.extra_ids = ids.new_empty(0)
        self.extra_weight = head.weight.new_empty(0, head.in_features, dtype=torch.float32)
        self.extra_bias = None
        self._all_ids = ids
        self.static = self.known.clone()  # the first `keep` ids and the specials
        self.recent: collections.deque[bool] = collections.deque(
            maxlen=WIDEN_WINDOW
        )  # read ids outside `static`
        self.full: nn.Module | None = None  # the whole head, once widened

    def _read(self, _embedding: nn.Module, args: tuple) -> None:
        """The input embedding's forward pre-hook (a bound method, so a deep copy follows its model)."""
        self.see(args[0])

    def see(self, input_ids: torch.Tensor) -> None:
        """Keep every id of `input_ids` from now on (a no-op for ids already kept)."""
        if self.full is not None:
            return
        flat = input_ids.reshape(-1)
        flat = flat[(flat >= 0) & (flat < self.vocab)]
        self.recent.extend((~self.static[flat[-WIDEN_WINDOW:]]).tolist())
        if len(self.recent) >= WIDEN_MIN and sum(self.recent) > WIDEN_SHARE * len(self.recent):
            self.widen()
            return
        new = torch.unique(flat[~self.known[flat]])
        if new.numel() == 0:  # one small host check per draft forward, on the CPU
            return
        self.known[new] = True
        rows = self._rows.index_select(0, new).float()
        self.extra_ids = torch.cat([self.extra_ids, new])
        self.extra_weight = torch.cat([self.extra_weight, rows])
        if self._row_bias is not None:
            bias = self._row_bias[new].float()
            self.extra_bias = bias if self.extra_bias is None else torch.cat([self.extra_bias, bias])
        self._all_ids = torch.cat([self.ids, self.extra_ids])

    def widen(self) -> None:
        """Every id from now on: the whole head, in the static product's format (about a second
        for the 0.5B draft's 151936 x 896 int8 head, once). An int8 head is packed for fbgemm
        only: a draft's head multiplies one row per step (a prompt's last, a chain's next), and
        oneDNN's second packing of it cost half a second more on the AMX Xeon."""
        plain = nn.Linear(
            self.in_features, self.vocab, bias=False, device="meta"
        )  # the original rows, no copy
        plain.weight = nn.Parameter(self._rows, requires_grad=False)
        plain.bias = None if self._row_bias is None else nn.Parameter(self._row_bias, requires_grad=False)
        if type(self.linear) is nn.Linear:
            whole = plain
        elif isinstance(self.linear, Int8WeightOnlyLinear):
            whole = Int8WeightOnlyLinear(plain)
        else:
            bias = None if self._row_bias is None else self._row_bias.float()
            whole = int8.linear_of(self._rows, bias, wide=False)
        self.full = whole
        self.known[:] = True

    def spread(self, kept: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Full-width logits from the static product `kept` (and the read ids' product)."""
        if self.extra_ids.numel():
            extra = nn.functional.linear(hidden.float(), self.extra_weight, self.extra_bias).to(kept.dtype)
            kept = torch.cat([kept, extra], -1)
        full = kept.new_full((*kept.shape[:-1], self.vocab), float("-inf"))
        full[..., self._all_ids] = kept
        return full

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.full is not None:
            return self.full(hidden)
        return self.spread(self.linear(hidden), hidden)


def prune_head(model: nn.Module, keep: int, special_ids: tuple[int, ...] = ()) -> None:
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ConfigError("--draft-quant prune needs a linear output layer")
    vocab = head.out_features
    if keep < 1:
        raise ConfigError(f"the pruned head must keep at least one id, got {keep}")
    if keep >= vocab:  # nothing to prune: the head stays as it is
        return
    specials = [i for i in special_ids if 0 <= i < vocab and i >= keep]
    ids = torch.tensor(list(range(keep)) + sorted(set(specials)), dtype=torch.long, device=head.weight.device)
    pruned = PrunedHead(head, ids)
    model.set_output_embeddings(pruned)
    if getattr(model.config, "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False  # the input embedding keeps every row
    model.get_input_embeddings().register_forward_pre_hook(pruned._read)


# -- int8 ----------------------------------------------------------------------------------------
class Int8WeightOnlyLinear(nn.Module):
    """y = x @ (scale * W_int8)^T + b with per-output-channel scales; x stays in its dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        self.register_buffer("qweight", torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(linear.weight.dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).to(self.scales.dtype)
        y = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def quantize_int8_weight_only(model: nn.Module) -> None:
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, child_name, Int8WeightOnlyLinear(child))
