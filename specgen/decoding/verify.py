"""Verify and accept: one target forward over every row's [root, proposal], then each row's
acceptance rule, read back with as few host syncs as possible.

Rows are padded at the end to the widest. Without trees the default causal mask serves every
row (a pad is a query nobody reads, and no real token sees it). With trees each row gets its
ancestor mask, and pads see only the cache and themselves. Chain rows (and rows that proposed
nothing) are read in ONE sync for the whole batch; a tree row's walk needs one of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgen.config import GenerationConfig, SamplingConfig
from specgen.decoding import synthetic
from specgen.decoding.acceptance import (Rule, greedy_match, greedy_tree, point_mass_sampling, recursive_rejection,
                                         select_rule, speculative_sampling)
from specgen.decoding.drafters.base import Proposal
from specgen.decoding.events import TokenLogprob
from specgen.decoding.replay import keyed_choice
from specgen.decoding.sampling import sample, warp
from specgen.decoding.tree import DraftTree
from specgen.runtime import kvcache


@dataclass(frozen=True)
class Verdict:
    """One row's outcome of a round, in host ids."""

    draft: list[int]  # the proposal's tokens
    path: list[int]  # accepted nodes, root to leaf (node j is draft[j - 1])
    token: int  # the target's own token after the path (correction or bonus)
    tried: list[int]  # tree: nodes tried and rejected, in the order they were tried

    @property
    def accepted(self) -> int:
        return len(self.path)


@dataclass(frozen=True)
class RowInput:
    """What verification needs of one row."""

    length: int  # committed tokens (the cache holds all but the last)
    proposal: Proposal
    sampling: SamplingConfig
    generator: torch.Generator | None
    index: int = 0  # the prompt's position in the input (synthetic acceptance keys its draws by it)


@dataclass(frozen=True)
class Scored:
    """The verify forward's result: logits [rows, width, V]; per row its input tokens (root
    first) and, for a proposal that is not a chain, its tree (root included)."""

    logits: torch.Tensor
    inputs: list[torch.Tensor]
    trees: list[DraftTree | None]


def forward(steps, cache, rows: list[RowInput], roots: torch.Tensor) -> Scored:
    """ONE target forward over every row's [root, proposal]."""
    device = roots.device
    inputs = [torch.cat([roots[i], row.proposal.tokens.to(device)]) if row.proposal.size else roots[i]
              for i, row in enumerate(rows)]
    trees = [DraftTree(t, (-1,) + row.proposal.parents) if row.proposal.size and not row.proposal.is_chain
             else None for t, row in zip(inputs, rows)]
    if len(rows) == 1:
        if trees[0] is not None:
            return Scored(steps.tree(cache, inputs[0], trees[0]), inputs, trees)
        return Scored(steps.forward(cache, inputs[0].unsqueeze(0)), inputs, trees)
    width = max(t.shape[0] for t in inputs)
    ids = torch.stack([torch.nn.functional.pad(t, (0, width - t.shape[0])) for t in inputs])
    if all(tree is None for tree in trees):
        return Scored(steps.forward(cache, ids), inputs, trees)
    mask = torch.zeros(len(rows), width, width, dtype=torch.bool)
    depth = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (t, tree) in enumerate(zip(inputs, trees)):
        n = t.shape[0]
        if tree is not None:
            mask[i, :n, :n] = tree.ancestor_mask
            depth[i, :n] = torch.tensor(tree.depth)
        else:
            mask[i, :n, :n] = kvcache.chain_tree(n)
            depth[i, :n] = torch.arange(n)
        mask[i, range(n, width), range(n, width)] = True
    return Scored(steps.forward(cache, ids, depth=depth, tree=mask), inputs, trees)


def accept(rows: list[RowInput], scored: Scored, config: GenerationConfig, vocab: int | None) -> list[Verdict]:
    """Each row's verdict under the rule `select_rule` picks for it."""
    logits, inputs = scored.logits[:, :, :vocab], scored.inputs
    keyed = config.deterministic
    verdicts: list[Verdict | None] = [None] * len(rows)
    flat = []  # chain rows: (row, accepted, token) as tensors, read in one sync below
    for i, row in enumerate(rows):
        proposal, n = row.proposal, inputs[i].shape[0]
        row_logits = logits[i, :n]
        greedy = row.sampling.greedy or keyed
        rule = select_rule(greedy, proposal.kind, proposal.size, proposal.is_chain, config.acceptance.mode)
        if rule is Rule.GREEDY_TREE or rule is Rule.RECURSIVE_REJECTION:
            tree = scored.trees[i]
            if rule is Rule.GREEDY_TREE:
                positions = [row.length + d for d in tree.depth]  # node i predicts position n + depth
                walked = greedy_tree(tree.children, inputs[i], choice(row_logits, positions, row.sampling, keyed))
            else:
                walked = recursive_rejection(tree.children, inputs[i], proposal.probs.to(logits.device),
                                             warp(row_logits, row.sampling), row.generator,
                                             replacement=proposal.replacement)
            verdicts[i] = Verdict(walked.node_tokens[1:], walked.path, walked.token, walked.tried)
            continue
        draft = inputs[i][1:]
        if rule is Rule.TARGET_ONLY:
            if greedy:
                token = choice(row_logits, [row.length], row.sampling, keyed)[0]
            else:
                token = sample(warp(row_logits[0], row.sampling), row.generator)
            flat.append((i, torch.zeros((), dtype=torch.long, device=logits.device), token.view(())))
            continue
        if rule is Rule.SYNTHETIC:  # benchmarks only: a recorded length, then the target's token
            chosen = synthetic.verdict(draft, row_logits, config.acceptance, row.index, row.length, row.sampling,
                                       row.generator)
        elif rule is Rule.GREEDY_MATCH:
            chosen = greedy_match(draft, choice(row_logits, list(range(row.length, row.length + n)), row.sampling,
                                                keyed))
        elif rule is Rule.SPECULATIVE_SAMPLING:
            chosen = speculative_sampling(draft, proposal.probs.to(logits.device), warp(row_logits, row.sampling),
                                          row.generator)
        else:
            chosen = point_mass_sampling(draft, warp(row_logits, row.sampling), row.generator)
        flat.append((i, chosen.accepted.view(()), chosen.token.view(())))
    if flat:
        drafts = [inputs[i][1:] for i, _, _ in flat]
        values = torch.cat([torch.stack([a for _, a, _ in flat]), torch.stack([t for _, _, t in flat]),
                            *drafts]).tolist()  # the round's one sync for chain and plain rows
        m, offset = len(flat), 2 * len(flat)
        for j, (i, _, _) in enumerate(flat):
            k = drafts[j].shape[0]
            accepted = values[j]
            verdicts[i] = Verdict(values[offset: offset + k], list(range(1, accepted + 1)), values[m + j], [])
            offset += k
    return verdicts


def logprobs(rows: list[RowInput], scored: Scored, verdicts: list[Verdict],
             vocab: int | None) -> list[list[TokenLogprob] | None]:
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
        verdict = verdicts[i]
        picks.append(scored.logits[i, [0] + verdict.path, :vocab])
        tokens += [verdict.draft[node - 1] for node in verdict.path] + [verdict.token]
    entries = token_logprobs(torch.cat(picks), tokens, max(rows[i].sampling.logprobs for i in wanted))
    start = 0
    for i in wanted:
        n, k = len(verdicts[i].path) + 1, rows[i].sampling.logprobs
        out[i] = [TokenLogprob(e.logprob, e.top[:k]) for e in entries[start:start + n]]
        start += n
    return out


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int, rank: bool = False) -> list[TokenLogprob]:
    """Each of `tokens` under its row of `logits` [n, V] (the position before it), with the `top`
    most likely tokens there and, with `rank`, its own rank; one host read for all of them."""
    log = torch.log_softmax(logits.float(), dim=-1)
    chosen = log.gather(1, torch.tensor(tokens, device=log.device)[:, None])
    best = log.topk(max(top, 1), dim=-1)
    ranks = (log > chosen).sum(dim=-1, keepdim=True).float() + 1 if rank else torch.zeros_like(chosen)
    # ids below 2**24 are exact in float32, and vocabularies are far smaller
    table = torch.cat([chosen, ranks, best.values, best.indices.float()], dim=1).tolist()
    width = best.values.shape[1]
    return [TokenLogprob(line[0], tuple((int(line[2 + width + j]), line[2 + j]) for j in range(top)), int(line[1]))
            for line in table]


def choice(logits: torch.Tensor, positions: list[int], sampling: SamplingConfig, keyed: bool) -> torch.Tensor:
    """The target's token per row of logits: argmax, or in deterministic mode the keyed draw."""
    if keyed:
        return keyed_choice(logits, torch.tensor(positions, device=logits.device), sampling)
    return logits.argmax(dim=-1)
