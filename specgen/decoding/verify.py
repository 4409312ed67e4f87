"""Verify and accept: one target forward over every row's [root, proposal], then each row's
acceptance rule, read back in ONE host sync for the whole batch.

Rows are padded at the end to the widest (and the forward's products skip the pads: lean.py's
`_Rows`). Without trees the default causal mask serves every
row (a pad is a query nobody reads, and no real token sees it). With trees each row gets its
ancestor mask, and pads see only the cache and themselves. Every rule's verdict stays on the
device until that sync; each row's walk (acceptance.walk) then gives its RoundResult.
"""

from __future__ import annotations

import torch

from specgen.config import GenerationConfig, SamplingConfig
from specgen.decoding import synthetic
from specgen.decoding.acceptance import (
    Rule,
    Verdict,
    greedy_match,
    greedy_tree,
    point_mass_sampling,
    point_mass_tree,
    recursive_rejection,
    select_rule,
    speculative_sampling,
    walk,
)
from specgen.decoding.drafters.base import Proposal
from specgen.decoding.events import RoundResult, TokenLogprob
from specgen.decoding.replay import keyed_choice
from specgen.decoding.rows import DecodeState
from specgen.decoding.sampling import sample, warp
from specgen.runtime import kvcache


def inputs(proposals: list[Proposal], roots: torch.Tensor) -> list[torch.Tensor]:
    """Each row's verify input, [root, proposal] (root first)."""
    device = roots.device
    return [
        torch.cat([roots[i], proposal.tokens.to(device)]) if proposal.size else roots[i]
        for i, proposal in enumerate(proposals)
    ]


def forward(steps, cache, proposals: list[Proposal], inputs: list[torch.Tensor]) -> torch.Tensor:
    """ONE target forward over every row's input (`inputs`): logits [rows, width, V]."""
    trees = [not proposal.is_chain for proposal in proposals]
    if len(proposals) == 1:
        if trees[0]:
            return steps.tree(cache, inputs[0], proposals[0])
        return steps.forward(cache, inputs[0].unsqueeze(0))
    widths = [t.shape[0] for t in inputs]
    width = max(widths)
    ids = torch.stack([torch.nn.functional.pad(t, (0, width - t.shape[0])) for t in inputs])
    # rows of different widths: the products run over the real tokens only (lean.py)
    packed = None if min(widths) == width or steps.fixed else _real(widths, width)
    if not any(trees):
        return steps.forward(cache, ids, packed=packed)
    mask = torch.zeros(len(proposals), width, width, dtype=torch.bool)
    depth = torch.zeros(len(proposals), width, dtype=torch.long)
    for i, (t, proposal) in enumerate(zip(inputs, proposals)):
        n = t.shape[0]
        if trees[i]:
            mask[i, :n, :n] = proposal.ancestor_mask
            depth[i, :n] = torch.tensor(proposal.depth)
        else:
            mask[i, :n, :n] = kvcache.chain_tree(n)
            depth[i, :n] = torch.arange(n)
        mask[i, range(n, width), range(n, width)] = True
    return steps.forward(cache, ids, depth=depth, tree=mask, packed=packed)


def _real(widths: list[int], width: int) -> torch.Tensor:
    """The flat indices of the real tokens of rows `widths` wide padded to `width`."""
    return torch.tensor([row * width + j for row, n in enumerate(widths) for j in range(n)])


def accept(
    rows: list[DecodeState],
    proposals: list[Proposal],
    logits: torch.Tensor,
    inputs: list[torch.Tensor],
    vocab: int | None,
) -> list[RoundResult]:
    """Each row's verdict under the rule `select_rule` picks for it, from the verify forward's
    `logits` over `inputs`, every row's read in one sync and walked: the round's result (what
    the engine commits is its to add). The rows are as the round found them (nothing committed
    yet)."""
    logits = logits[:, :, :vocab]
    verdicts = [
        rule_verdict(row, proposal, logits[i, : inputs[i].shape[0]], inputs[i], row.config)
        for i, (row, proposal) in enumerate(zip(rows, proposals))
    ]
    values = torch.cat(
        [
            part
            for verdict, tokens in zip(verdicts, inputs)
            for part in (verdict.passed.to(torch.int64), verdict.token, tokens)
        ]
    ).tolist()  # the sync
    results, offset = [], 0
    for proposal, tokens in zip(proposals, inputs):
        n = tokens.shape[0] - 1
        passed, token = values[offset : offset + n], values[offset + n : offset + 2 * n + 1]
        nodes = values[offset + 2 * n + 1 : offset + 3 * n + 2]
        offset += 3 * n + 2
        path, target, tried = walk(proposal.children, passed, token)
        results.append(
            RoundResult(
                draft_tokens=nodes[1:],
                parents=proposal.parents,
                origin=proposal.origin,
                path=tuple(path),
                target_token=target,
                tried=tuple(tried),
                root=nodes[0],
            )
        )
    return results


def rule_verdict(
    row: DecodeState,
    proposal: Proposal,
    row_logits: torch.Tensor,
    tokens: torch.Tensor,
    config: GenerationConfig,
) -> Verdict:
    """One row's verdict, on the device. row_logits [n + 1, V] from the verify forward, tokens
    [n + 1] its input (root first)."""
    keyed, length = config.deterministic, len(row.ids)  # committed tokens (the cache holds all but the last)
    greedy = row.sampling.greedy or keyed
    rule = select_rule(greedy, proposal.kind, proposal.size, proposal.is_chain, config.acceptance.mode)
    draft = tokens[1:]
    if rule is Rule.TARGET_ONLY:
        if greedy:
            token = choice(row_logits, [length], row.sampling, keyed)[:1]
        else:
            token = sample(warp(row_logits[0], row.sampling), row.generator).view(1)
        return Verdict(draft.new_zeros(0, dtype=torch.bool), token)
    if rule is Rule.SYNTHETIC:  # benchmarks only: a recorded length, then the target's token
        return synthetic.verdict(
            draft, row_logits, config.acceptance, row.index, length, row.sampling, row.generator
        )
    if rule is Rule.GREEDY_MATCH or rule is Rule.GREEDY_TREE:
        positions = [length + d for d in proposal.depth]  # node i predicts position n + depth
        chosen = choice(row_logits, positions, row.sampling, keyed)
        if rule is Rule.GREEDY_MATCH:
            return greedy_match(draft, chosen)
        return greedy_tree(proposal.parents, draft, chosen)
    if rule is Rule.RECURSIVE_REJECTION:
        return recursive_rejection(
            proposal.children,
            draft,
            proposal.probs.to(row_logits.device),
            warp(row_logits, row.sampling),
            row.generator,
            replacement=proposal.replacement,
        )
    if rule is Rule.POINT_MASS_TREE:
        return point_mass_tree(proposal.children, draft, warp(row_logits, row.sampling), row.generator)
    if rule is Rule.SPECULATIVE_SAMPLING:
        return speculative_sampling(
            draft, proposal.probs.to(row_logits.device), warp(row_logits, row.sampling), row.generator
        )
    return point_mass_sampling(draft, warp(row_logits, row.sampling), row.generator)


def logprobs(
    rows: list[DecodeState], logits: torch.Tensor, results: list[RoundResult], vocab: int | None
) -> list[list[TokenLogprob] | None]:
    """Per row whose sampling asks for them, each kept token's log-probability under the target
    and the most likely tokens at its position, from the verify forward's logits (as the model
    gives them: the target's own distribution, not the warped one a token was drawn from).
    A token is predicted by its parent's position: the root predicts the first, node j the
    child after it on the path, the path's last node the target's own token. One host sync for
    all rows, and only in rounds where some row asks."""
    wanted = [i for i, row in enumerate(rows) if row.sampling.logprobs is not None]
    out: list[list[TokenLogprob] | None] = [None] * len(rows)
    if not wanted:
        return out
    picks, tokens = [], []
    for i in wanted:
        result = results[i]
        picks.append(logits[i, [0, *result.path], :vocab])
        tokens += [result.draft_tokens[node - 1] for node in result.path] + [result.target_token]
    entries = token_logprobs(torch.cat(picks), tokens, max(rows[i].sampling.logprobs for i in wanted))
    start = 0
    for i in wanted:
        n, k = len(results[i].path) + 1, rows[i].sampling.logprobs
        out[i] = [TokenLogprob(e.logprob, e.top[:k]) for e in entries[start : start + n]]
        start += n
    return out


def token_logprobs(
    logits: torch.Tensor, tokens: list[int], top: int, rank: bool = False
) -> list[TokenLogprob]:
    """Each of `tokens` under its row of `logits` [n, V] (the position before it), with the `top`
    most likely tokens there and, with `rank`, its own rank; one host read for all of them."""
    log = torch.log_softmax(logits.float(), dim=-1)
    chosen = log.gather(1, torch.tensor(tokens, device=log.device)[:, None])
    best = log.topk(max(top, 1), dim=-1)
    ranks = (log > chosen).sum(dim=-1, keepdim=True).float() + 1 if rank else torch.zeros_like(chosen)
    # ids below 2**24 are exact in float32, and vocabularies are far smaller
    table = torch.cat([chosen, ranks, best.values, best.indices.float()], dim=1).tolist()
    width = best.values.shape[1]
    return [
        TokenLogprob(
            line[0], tuple((int(line[2 + width + j]), line[2 + j]) for j in range(top)), int(line[1])
        )
        for line in table
    ]


def choice(logits: torch.Tensor, positions: list[int], sampling: SamplingConfig, keyed: bool) -> torch.Tensor:
    """The target's token per row of logits: argmax, or in deterministic mode the keyed draw."""
    if keyed:
        return keyed_choice(logits, torch.tensor(positions, device=logits.device), sampling)
    return logits.argmax(dim=-1)
