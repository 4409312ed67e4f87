"""A draft's pruned output layer and weight-only int8 linears (`--draft-quant prune`, `int8-wo`).

* `PrunedHead`: the output layer keeps the first `keep` token ids (byte-level BPE ids are in
  merge order, so low ids are the frequent pieces), the special tokens, and every token the
  draft has read: ids in the prompt or in the committed text join the kept set the first time
  the draft's embedding sees them (a prompt's identifiers, a code fence), computed from the
  original head rows. Every other logit is -inf, so the draft never proposes those ids and the
  distribution it reports (softmax over the kept ids, exact zeros elsewhere) is exactly the one
  it samples from. Speculative sampling stays lossless; only the acceptance rate can change.
  Text that mostly lives outside the first ids (Chinese, Japanese and Korean pieces are spread
  over ids 32768-151643 in Qwen's vocabulary) makes the head pack more ids, in the static
  product's format, once TRIP different ids of them are among the last WINDOW ids the draft
  read outside the kept ones:
  - ids of one script (`Scripts`, where the tokenizer was given): every id of that script. A
    Chinese answer trips it at its third or fourth token and packs Qwen's 25,900 ideograph ids
    (0.25-0.4 s once; one product, 1.3-1.6 ms a draft step on a 2-core AVX2 CPU). Packing
    only the blocks those first ids fell in left out the common Chinese words, which sit 40
    to a block among the English ones, and the draft accepted 10 of 28 tokens of a 26-token
    answer where the whole head accepted 18 of 19. The scripts are read from the tokenizer at
    load (see `Scripts`);
  - ids of one block of BLOCK_ROWS: every block with JOIN different ids among them (rare
    words and identifiers have no script; about 20 ms a block, 0.2 ms of head per step).
  The whole head would take 1.3-1.8 s to pack and 5.3 ms a step (1.0 ms pruned). Most English
  text and code packs nothing, some a block or two (rare words and identifiers, read one by
  one, stay in the read ids' product). Each packing counts in `widened`: a row whose floor its
  rounds lowered measures afresh, since they measured a draft that could not propose the text.
* `Int8WeightOnlyLinear`: int8 weights per output channel, activations in their own dtype,
  through torch's `_weight_int8pack_mm` CPU kernel.

Both keep the model's forward signature and a full-width logits tensor, so every drafter
(chain, trees, batches) works unchanged. runtime/quant.py parses and applies the option.
"""

from __future__ import annotations

import collections
from typing import Callable

import torch
from torch import nn

from specgen.errors import ConfigError
from specgen.runtime import int8
from specgen.runtime.scripts import TRIP, Scripts

DEFAULT_KEEP = 32768
WINDOW = 128  # the last ids read that PrunedHead.see counts
BLOCK_ROWS = 4096
JOIN = 2  # different ids of a block among the recent reads that packs it, once one has TRIP: PrunedHead.see


# -- pruned output layer ------------------------------------------------------------------------
class PrunedHead(nn.Module):
    """logits[..., ids] = x @ W[ids]^T for the kept ids; every other logit is -inf (never proposed).

    Three products make the kept logits:
    - the static ids (the first `keep` and the specials) in an inner nn.Linear, so the int8
      variants quantize it like any layer;
    - `blocks`: blocks of the vocabulary packed once text needed them (see `cover`), in the
      static product's format;
    - the ids read one by one: `see(input_ids)` (called by a pre-hook on the model's input
      embedding, so every forward path and drafter gets it) adds the ids the draft reads that
      are not kept yet; their rows, taken from the original head weight (the input embedding
      itself when they are tied, so no extra memory), form a small fp32 product that grows
      with the text.
    Each kept id is in exactly one of them. Scripts and blocks an earlier process learned can
    be packed at load and held out of the forward until their first id is read (`hold`).
    """

    def __init__(
        self, head: nn.Linear, ids: torch.Tensor, block_rows: int = BLOCK_ROWS, scripts: Scripts | None = None
    ):
        super().__init__()
        self.vocab, self.in_features = head.out_features, head.in_features
        self.out_features = self.vocab
        self.block_rows = block_rows
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
        self.covered = self.known.clone()  # the static ids and every packed block's
        self.blocks = nn.ModuleList()  # the packed blocks' products, in the order of `block_ids`
        self.block_ids: list[torch.Tensor] = []
        self.extra_ids = ids.new_empty(0)
        self.extra_weight = head.weight.new_empty(0, head.in_features, dtype=torch.float32)
        self.extra_bias = None
        self._all_ids = ids
        self.recent: collections.deque[int] = collections.deque(
            maxlen=WINDOW
        )  # the last ids read: the id where it was outside `covered`, else -1
        self.complete = False  # every id in the static product or a packed block
        self.scripts = scripts  # each id's script, where the tokenizer was given (see `see`)
        self.widened = 0  # times ids were packed: what the draft can propose grew (drafters' floors)
        # the scripts and blocks packed since load (runtime/head_memory.py keeps them for later loads)
        self.learned_scripts: set[int] = set()
        self.learned_blocks: set[int] = set()
        # remembered scripts and blocks, packed at load and joined at their first id read (`hold`)
        self.waiting = nn.ModuleDict()  # "s<script>" / "b<block>" -> its product, until it joins
        self.held: list[tuple[str, torch.Tensor]] = []  # (key, its ids) of every group held at load
        self.wakes = torch.full((self.vocab,), -1, dtype=torch.int32, device=ids.device)  # id -> held[i]

    def _read(self, _embedding: nn.Module, args: tuple) -> None:
        """The input embedding's forward pre-hook (a bound method, so a deep copy follows its model)."""
        self.see(args[0])

    def see(self, input_ids: torch.Tensor) -> None:
        """Keep every id of `input_ids` from now on (a no-op for ids already kept). Once a script
        (see Scripts) has TRIP different ids among the last WINDOW ids read outside the covered
        set, pack every id of it: the text lives in that script. Then, once a block has TRIP
        different ids among them, pack every block with JOIN or more: a block two of its ids
        fell in is likely to be read again (rare words and identifiers, which have no script).
        Different ids, not reads: an identifier read over and over is one id, proposable
        already from the read ids' product."""
        if self.complete:
            return
        flat = input_ids.reshape(-1)
        flat = flat[(flat >= 0) & (flat < self.vocab)]
        tail = flat[-WINDOW:]
        marked = torch.where(self.covered[tail], -1, tail).tolist()
        if self.waiting and (len(flat) > WINDOW or max(marked, default=-1) >= 0) and self._wake(flat):
            marked = torch.where(self.covered[tail], -1, tail).tolist()
        self.recent.extend(marked)
        if max(marked, default=-1) >= 0:  # something outside arrived: count the window's scripts, blocks
            ids = {i for i in self.recent if i >= 0}
            if self.scripts is not None:
                tripped = self.scripts.tripped(ids)
                if tripped:
                    self.pack([self.scripts.ids(s) for s in tripped])
                    self.learned_scripts.update(tripped)
                    ids = {i for i in self.recent if i >= 0}
            per_block = collections.Counter(i // self.block_rows for i in ids)
            if per_block and max(per_block.values()) >= TRIP:
                self.cover(sorted(b for b, n in per_block.items() if n >= JOIN))
            if self.complete:
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
        self._all_ids = torch.cat([self.ids, *self.block_ids, self.extra_ids])

    def cover(self, chosen: list[int]) -> None:
        """Pack the blocks `chosen` (block numbers: ids b * BLOCK_ROWS onwards) all at once, in
        the static product's format. An int8 head's blocks are packed for fbgemm only: a draft's
        head multiplies one row per step (a prompt's last, a chain's next), and oneDNN's second
        packing costs more than it would save. Ids read one by one that a block now covers
        leave the fp32 product, and the recent reads they cover no longer count as outside."""
        self.learned_blocks.update(chosen)
        self.pack([self._block_ids(b) for b in chosen])

    def pack(self, groups: list[torch.Tensor]) -> None:
        """Pack the ids of each of `groups` not covered yet (ascending ids), one product a group
        (see `cover`): one int8 product of a script's 25,900 ids took 1.3-1.6 ms a draft step on
        a 2-core AVX2 CPU, seven of 4096 ids 2.8 ms."""
        ranges = []
        for ids in groups:
            ids = ids.to(self.covered.device)
            ids = ids[~self.covered[ids] & (self.wakes[ids] < 0)]  # a waiting group keeps its own
            ranges += [ids] if ids.numel() else []
        if ranges:
            self._join(ranges, self._products(ranges))

    def hold(self, scripts: list[int], blocks: list[int]) -> None:
        """Pack the ids of `scripts` and `blocks` (each minus what is covered or held already)
        now, in the static product's format, but leave them out of the forward until the draft
        reads one of their ids: then the group joins at once (`see`), at its first id where a
        script or block the head has not seen needs TRIP. runtime/head_memory.py holds what
        earlier processes learned this way, so text that needs none of it pays nothing per
        step for it, and text that does has it from its first id on, with no packing in the
        request."""
        device, taken = self.covered.device, self.covered | (self.wakes >= 0)
        groups = [(f"s{s}", self.scripts.ids(s)) for s in scripts] if self.scripts is not None else []
        groups += [(f"b{b}", self._block_ids(b)) for b in blocks]
        held = []
        for key, ids in groups:
            ids = ids.to(device)
            ids = ids[~taken[ids]]
            if ids.numel():
                taken[ids] = True
                held.append((key, ids))
        for (key, ids), product in zip(held, self._products([ids for _, ids in held])):
            self.wakes[ids] = len(self.held)
            self.held.append((key, ids))
            self.waiting[key] = product

    def _wake(self, read: torch.Tensor) -> bool:
        """Join the held groups (see `hold`) that an id of `read` is in; whether any joined."""
        found = self.wakes[read]
        found = torch.unique(found[found >= 0]).tolist()
        if not found:
            return False
        groups = [self.held[i] for i in found]
        for key, ids in groups:
            (self.learned_scripts if key[0] == "s" else self.learned_blocks).add(int(key[1:]))
            self.wakes[ids] = -1
        self._join([ids for _, ids in groups], [self.waiting.pop(key) for key, _ in groups])
        return True

    def _block_ids(self, block: int) -> torch.Tensor:
        first = block * self.block_rows
        return torch.arange(first, min(first + self.block_rows, self.vocab), device=self.covered.device)

    def _join(self, ranges: list[torch.Tensor], products: list[nn.Module]) -> None:
        """Add packed products, one per range of ids (disjoint, not covered yet), to the forward."""
        self.widened += 1
        for ids, product in zip(ranges, products):
            self.blocks.append(product)
            self.block_ids.append(ids)
            self.covered[ids] = True
        self.known |= self.covered
        left = ~self.covered[self.extra_ids]
        self.extra_ids, self.extra_weight = self.extra_ids[left], self.extra_weight[left]
        if self.extra_bias is not None:
            self.extra_bias = self.extra_bias[left]
        self._all_ids = torch.cat([self.ids, *self.block_ids, self.extra_ids])
        self.complete = bool(self.covered.all())
        self.recent = collections.deque((-1 if i < 0 or self.covered[i] else i for i in self.recent), WINDOW)

    def _products(self, ranges: list[torch.Tensor]) -> list[nn.Module]:
        """One product per block of ids, in the static product's format."""
        rows = [self._block(self._rows, ids) for ids in ranges]
        biases = [None if self._row_bias is None else self._block(self._row_bias, ids) for ids in ranges]
        if type(self.linear) is not nn.Linear and not isinstance(self.linear, Int8WeightOnlyLinear):
            return int8.linears_of(rows, [None if b is None else b.float() for b in biases], wide=False)
        products = []
        for weight, bias in zip(rows, biases):
            plain = nn.Linear(self.in_features, len(weight), bias=False, device="meta")
            plain.weight = nn.Parameter(weight, requires_grad=False)  # the original rows
            plain.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
            products.append(plain if type(self.linear) is nn.Linear else Int8WeightOnlyLinear(plain))
        return products

    @staticmethod
    def _block(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """rows[ids]: a view when the ids are one run (no copy of a 16-bit head's rows)."""
        first, last = int(ids[0]), int(ids[-1])
        return rows[first : last + 1] if last - first + 1 == len(ids) else rows.index_select(0, ids)

    def spread(self, kept: torch.Tensor, blocks: list[torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        """Full-width logits from the static product `kept`, the blocks' products and the read
        ids' product."""
        parts = [kept, *(block.to(kept.dtype) for block in blocks)]
        if self.extra_ids.numel():
            parts.append(
                nn.functional.linear(hidden.float(), self.extra_weight, self.extra_bias).to(kept.dtype)
            )
        kept = torch.cat(parts, -1) if len(parts) > 1 else kept
        full = kept.new_full((*kept.shape[:-1], self.vocab), float("-inf"))
        full[..., self._all_ids] = kept
        return full

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.spread(self.linear(hidden), [block(hidden) for block in self.blocks], hidden)


def prune_head(
    model: nn.Module,
    keep: int,
    special_ids: tuple[int, ...] = (),
    block_rows: int = BLOCK_ROWS,
    tokenizer=None,
) -> None:
    """Replace `model`'s output layer by a PrunedHead that keeps the first `keep` ids and the
    special ids; `tokenizer` (the draft's ids' own) lets it pack a script's ids at once."""
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
    scripts = None if tokenizer is None else Scripts(tokenizer, vocab)
    if scripts is not None:
        scripts.all()  # read (or read back) at load, not when a text turns to another script
    pruned = PrunedHead(head, ids, block_rows, scripts)
    model.set_output_embeddings(pruned)
    if getattr(model.config, "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False  # the input embedding keeps every row
    model.get_input_embeddings().register_forward_pre_hook(pruned._read)


def head_of(model: nn.Module) -> PrunedHead | None:
    """`model`'s pruned output layer, if it has one (its `widened` counts the times it packed
    ids: what the draft can propose grew each time)."""
    return next((module for module in model.modules() if isinstance(module, PrunedHead)), None)


def widening(model: nn.Module) -> Callable[[], int]:
    """What a drafter of `model` answers to `Drafter.widened`: its pruned head's count, read
    when asked; always 0 for a head that is not pruned (it proposes every id from the start)."""
    head = head_of(model)
    return (lambda: head.widened) if head is not None else (lambda: 0)


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
