"""EAGLE-3's training-time test: a head trained on the inputs it will see when drafting.

At inference a head's first step reads the target's features; every later step reads the
head's own output from the step before. Training unrolls `steps` such steps over a whole
sequence at once. With n = T - 1 positions p (the head at p reads the target's features at p
and the token at p + 1):

* step 0 at index p: features fc(f_p), token x_(p+1), rotary position p;
* step i at index p: the output (before the norm) of step i - 1 at index p, token x_(p+1+i),
  position p + i; it stands for the i-th draft step after a round whose last verified
  position is p;
* attention: step i's query at index p sees step 0's keys at indices <= p (positions the target
  verified) and, for each s = 1..i, step s's key at index p only (the head's own draft
  positions), one softmax over all of them: what its K/V cache holds when drafting;
* the label of step i at index p is the target's greedy token after position p + 1 + i,
  counted where it is in the draft vocabulary, the index is valid (p < n - i) and the label's
  position is at or after the sequence's `start` (an answer's, not its prompt's). The loss is
  the cross-entropy, step i weighted 0.8^i (as EAGLE-3 and SpecForge weigh it).
"""

from __future__ import annotations

import torch
from torch import nn

from specgen.models.eagle_head import Eagle3Head, rotate

DECAY = 0.8
# the rows of `unroll`'s counts, per step: positions whose greedy draft equals the label, positions
# where steps 0..i are all right (accepted in a row), positions counted
CORRECT, CHAINED, COUNTED = range(3)


def unroll(
    head: Eagle3Head,
    features: torch.Tensor,
    ids: torch.Tensor,
    labels: torch.Tensor,
    start: int,
    steps: int,
    draft_index: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the weighted loss of one sequence, a scalar with a graph; its counts [3, steps], rows
    CORRECT, CHAINED, COUNTED). `features` [T, F] (the target's), `ids` [T], `labels` [T] (the
    target's greedy token after each position), `draft_index` [V] (draft id of a target id, -1
    outside the draft vocabulary)."""
    config, layer = head.config, head.midlayer
    attn = layer.self_attn
    n = ids.shape[0] - 1
    device = features.device
    index = torch.arange(n, device=device)
    hidden = head.fc(features[:n].float())
    causal = index[None, :] <= index[:, None]  # [n, n] step 0's keys j <= p
    keys, values = [], []  # per step [kv, n, d]
    total = features.new_zeros((), dtype=torch.float32)
    counts = torch.zeros(3, steps, dtype=torch.long)
    right = torch.ones(n, dtype=torch.bool, device=device)  # steps so far all right (a draft accepted so far)
    previous = None  # the last step's labels: the token a right draft fed this step
    scale = attn.head_dim**-0.5
    rep = config.heads // config.kv_heads
    for step in range(steps):
        shifted = torch.cat([ids[1 + step :], ids.new_zeros(step)])[:n]  # x_(p+1+i)
        target = torch.cat([labels[1 + step :], labels.new_zeros(step)])[:n]
        embeds = head.embed(shifted).to(hidden.dtype)
        normed = layer.hidden_norm(hidden)
        residual = normed if config.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)
        cos, sin = head.rotary(x[None], (index + step)[None])
        q = attn.q_proj(x).view(n, config.heads, attn.head_dim).transpose(0, 1)
        k = attn.k_proj(x).view(n, config.kv_heads, attn.head_dim).transpose(0, 1)
        v = attn.v_proj(x).view(n, config.kv_heads, attn.head_dim).transpose(0, 1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        keys.append(k)
        values.append(v)
        k0 = keys[0].repeat_interleave(rep, 0)
        v0 = values[0].repeat_interleave(rep, 0)
        scores = [(q @ k0.transpose(1, 2) * scale).masked_fill(~causal, float("-inf"))]  # [h, n, n]
        diagonal = [
            (q * keys[s].repeat_interleave(rep, 0)).sum(-1, keepdim=True) * scale for s in range(1, step + 1)
        ]
        weights = torch.softmax(torch.cat(scores + diagonal, dim=-1).float(), dim=-1).to(q.dtype)
        out = weights[..., :n] @ v0
        for s in range(1, step + 1):
            out = out + weights[..., n + s - 1 : n + s] * values[s].repeat_interleave(rep, 0)
        hidden = residual + attn.o_proj(out.transpose(0, 1).reshape(n, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        logits = head.lm_head(head.norm(hidden)).float()  # [n, Vd]
        wanted = draft_index[target]
        mask = (wanted >= 0) & (index < n - step) & (index + 1 + step >= start)
        if mask.any():
            loss = nn.functional.cross_entropy(logits[mask], wanted[mask])
            total = total + DECAY**step * loss
        hit = (logits.argmax(-1) == wanted) & mask
        if previous is not None:  # teacher-forced text the target would not have written breaks a chain
            right = right & (shifted == previous)
        right = right & (hit | ~mask)
        previous = target
        counts[CORRECT, step] = int(hit.sum())
        counts[CHAINED, step] = int((right & mask).sum())
        counts[COUNTED, step] = int(mask.sum())
    return total, counts
