"""Chain drafting with a draft model, batch-first: one draft forward per step for every row.

`ChainDrafter` keeps one position-indexed cache with a row per sequence. Cache invariant per
row: a stretch of the committed sequence from the row's `start`, numbered from 0 there: a prefix
(start 0), or on a CPU, for a prompt longer than WINDOW tokens, its last WINDOW tokens on. A
draft model reads a prompt at about a quarter of the target's cost, and a 1,700-token prompt
took it 8.5 s on a 2-core CPU, a third of the plain decoding of a 128-token answer
(benchmarks/avx2-epyc.md, "Long prompts"). It needs the recent text far more than the
beginning (prompt lookup copies from the whole prompt), and under rotary positions tokens
numbered from 0 attend to each other as they would in place. A window changes proposals only,
never what is committed. Where the draft's prefix store keeps rows' K/V (a server's, a prompt
set's), a prompt is read whole, as before: later requests that share it copy it from the
store, which a window's K/V, a stretch rather than a prefix, could not serve.

A row whose read would cost more than drafting can save drafts nothing with the model: where
the device's price of a prompt token read (costs.read_price, in target steps) times the tokens
the row has to read exceeds `gain` times the tokens it may generate (GAIN: what a model draft
saves a token against plain rounds, GAIN_BESIDE_LOOKUP against lookup's), the row sits every
round out, reads nothing and proposes nothing: its rounds are plain ones (chain) or lookup's
(lookup-chain). On a 2-core AVX2 CPU a prompt token costs the draft 0.036 plain steps, so a
300-token prompt 11, where a 64-token answer at 1.25x saves 13, and lookup-chain's draft beside
lookup about half that (benchmarks/floor.md, "A draft's read against what it can save"). A
fixed draft length (`--draft-tokens N`, no floor) always drafts, and where a prefix store keeps
prompts (a server's, a prompt set's) every row reads as before: later rows copy what it read.

A round feeds each row what it has not seen (the root, plus the last draft token after a fully
accepted round, plus anything committed while the row drafted nothing, as a lookup round of
lookup-chain), padded at the end to the widest row, then K-1 single-token steps for all rows;
x_K is never fed. Prompts are fed lazily: a row that is to draft and is further behind than a
few tokens (new, or back from plain rounds) is first fed alone, in a batch at most
`catch_up_chunk` tokens a round (a long prompt's catch-up would stall every row; the row drafts
nothing until it is caught up). A row further behind that does not draft this round sits the
round out (a pad token, its length restored). After the verdict a row keeps what was committed
of what it fed. A row's K/V goes to the draft model's prefix store after its catch-up and when
it finishes, and a joining row starts from the longest prefix stored there
(runtime/prefixes.py): a server's requests share a system prompt, a chat client's turn repeats
its conversation.

With a confidence stop (length.unsure) a row's draft ends once the product of the draft's top
probabilities over the round (its chance of still being right) falls below the threshold (the
token drawn is kept: lossless); the steps end when every row has stopped.
"""

from __future__ import annotations

import torch

from specgen.config import SamplingConfig
from specgen.decoding.acceptance import ProposalKind
from specgen.decoding.drafters.base import BaseDrafter, Proposal, ReadRule, embeddable
from specgen.decoding.length import ChainStops
from specgen.decoding.sampling import on_device, sample, warp
from specgen.decoding.staging import PREFILL_CHUNK
from specgen.runtime import head_memory, kvcache, pruned
from specgen.runtime.compiled import Steps
from specgen.runtime.prefixes import PrefixStore

CATCH_UP = 4  # unseen tokens a row feeds in the batched first step; more are fed row by row first
WINDOW = 512  # on a CPU, the prompt tokens a row reads at most: its last ones (see the module)
# what a model draft saves a token, in plain steps, against a row's rounds without it (see the
# module): plain ones (chain ran at 1.21x plain on every prompt on an AVX2 EPYC, 1.24x on a Xeon)
# and lookup's (lookup-chain at 1.27x and 1.33x where lookup alone ran at 1.17x and 1.16x)
GAIN, GAIN_BESIDE_LOOKUP = 0.2, 0.1


class ChainDrafter(BaseDrafter):
    """The Drafter protocol for chains from one draft model (base.py has the calls)."""

    def __init__(
        self,
        model,
        device: torch.device,
        vocab: int | None = None,
        confidence: float = 0.0,
        compile: str = "off",
        prefixes: PrefixStore | None = None,
        window: int | None = None,
        read_price: float | None = None,
        gain: float = GAIN,
    ):
        self.model, self.device, self.vocab, self.confidence = model, device, vocab, confidence
        # a prompt token's read in target steps (None: not measured, every row reads), and what a
        # drafted round saves a token against the row's rounds without this drafter
        self.read = ReadRule(read_price, gain)
        # the prompt tokens a row reads at most (0: all of them; a GPU reads a prompt cheaply)
        self.window = (WINDOW if device.type == "cpu" else 0) if window is None else window
        self.prefixes = prefixes if prefixes is not None else PrefixStore(budget=0)
        # tokens of a row's catch-up per round when other rows share it (0: all at once; a GPU)
        self.catch_up_chunk = PREFILL_CHUNK if device.type == "cpu" else 0
        self.steps = Steps(model, compile, exact=False)  # on CUDA: fixed-width steps as CUDA graphs
        self.cache = kvcache.SlotCache(model.config, rows=0)
        self.generators: list[torch.Generator | None] = []
        self._base: list[int] = []  # each row's context length at its last proposal
        self._fed: list[int] = []  # draft tokens fed at the last proposal
        self._contexts: list[list[int]] = []  # each row's sequence as last given (its cache holds a stretch)
        self._start: list[int] = []  # where each row's cache begins in its sequence (0: a prefix)
        self._dear: list[bool] = []  # rows whose read costs more than their drafts can save
        self._widening = pruned.widening(model)  # a pruned output layer widens as text needs
        self._remember = head_memory.keeper(model)  # and keeps what it learned for later processes

    # -- rows ---------------------------------------------------------------------------------
    def join(self, row: int, prompt_ids: list[int], generator, capacity: int, config=None) -> None:
        """Make room for the row; its prompt is fed lazily, at the row's first proposal, so a
        row that never drafts (a wide server batch at k = 0) never costs a draft forward."""
        while row >= self.cache.rows:
            self.cache.add_row()
            self.generators.append(None)
            self._base.append(0)
            self._fed.append(0)
            self._contexts.append([])
            self._start.append(0)
            self._dear.append(False)
        self.cache.reserve(capacity)
        held = min(self.cache.lengths[row], max(len(prompt_ids) - 1 - self._start[row], 0))
        kvcache.set_length(self.cache, row, held)
        if held == 0:  # a fresh row: the prompt's window where no prefix store keeps prefixes
            skip = len(prompt_ids) - self.window
            self._start[row] = skip if self.window and not self.prefixes.budget and skip > 0 else 0
        if self._start[row] == 0:
            self.prefixes.load(self.cache, row, prompt_ids, have=held)
        unread = len(prompt_ids) - self._start[row] - self.cache.lengths[row]
        # a store keeps what a row reads for later rows (a shared system prompt): every row reads
        self._dear[row] = self.read.declines(unread, config, stored=bool(self.prefixes.budget))
        self.generators[row] = on_device(generator, self.device)
        self._base[row], self._fed[row], self._contexts[row] = 0, 0, prompt_ids

    def declines(self, row: int) -> bool:
        return row < len(self._dear) and self._dear[row]

    def widened(self) -> int:
        return self._widening()

    def finished(self, row: int, ids: list[int]) -> None:
        """The row is done: its K/V goes to the prefix store, what its text taught a pruned head
        to the head's memory."""
        self._remember(ids)
        # a window is no prefix to store (windows are read only without a store: a guard, should
        # a store be given a budget after rows joined)
        if row < self.cache.rows and self._start[row] == 0:
            self.prefixes.save(self.cache, row, self._contexts[row])

    def leave(self, keep: list[int]) -> None:
        keep = [i for i in keep if i < self.cache.rows]
        self.cache.select(keep)
        self.generators = [self.generators[i] for i in keep]
        self._base = [self._base[i] for i in keep]
        self._fed = [self._fed[i] for i in keep]
        self._contexts = [self._contexts[i] for i in keep]
        self._start = [self._start[i] for i in keep]
        self._dear = [self._dear[i] for i in keep]

    def rewind(self, row: int, valid: int) -> None:
        if row < self.cache.rows:
            held = min(self.cache.lengths[row], max(valid - self._start[row], 0))
            kvcache.set_length(self.cache, row, held)

    def setup_seconds(self) -> float:
        return self.steps.setup_seconds

    # -- a round ------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(
        self, contexts: list[list[int]], ks: list[int], samplings: list[SamplingConfig], features=None
    ) -> list[Proposal]:
        ks = [0 if row < len(self._dear) and self._dear[row] else k for row, k in enumerate(ks)]
        if not any(ks):  # every row's read costs more than it can save: no draft forward
            return [Proposal.empty(self.device) for _ in contexts]
        count, steps = len(contexts), max(ks)
        self._catch_up(contexts, ks)
        # a row more than CATCH_UP behind after its catch-up sits the round out: a pad, no proposal
        seen = [start + length for start, length in zip(self._start, self.cache.lengths)]
        out_of_round = [len(context) - end > CATCH_UP for context, end in zip(contexts, seen)]
        new = [[0] if out else context[end:] for context, end, out in zip(contexts, seen, out_of_round)]
        width = max(len(tokens) for tokens in new)
        bases = list(self.cache.lengths)
        logits = self._first_step(new, width)
        kvcache.set_lengths(self.cache, [b + len(tokens) for b, tokens in zip(bases, new)])  # drop the pads
        # the rows' kinds decide how a step chooses: argmax for all, or laws when any row samples
        kinds = [ProposalKind.drafting(sampling) for sampling in samplings]
        sampled = ProposalKind.SAMPLED in kinds
        tokens, laws = [], []
        stops = ChainStops(self.confidence, ks, out_of_round)  # where each row's draft ends
        token = None  # each step after the first reads the step before's tokens
        for step in range(steps):
            if step:  # the previous step's tokens, straight from the device
                logits = self.steps.forward(self.cache, token.view(count, 1).to(self.device))[
                    :, -1, : self.vocab
                ]
            if sampled:
                token, law = self._sample(logits, samplings)
                laws.append(law)
            else:
                token, law = logits.argmax(dim=-1), None
            tokens.append(token)
            if step == steps - 1 or stops.after(step, logits, law):
                break
        fed = len(tokens) - 1
        self._base = [len(context) - start for context, start in zip(contexts, self._start)]
        self._contexts = list(contexts)
        self._fed = [fed] * count
        drafted = torch.stack(tokens, dim=1)  # [rows, K] on the device
        stacked = torch.stack(laws, dim=1) if sampled else None  # [rows, K, V]: a sampled row's laws
        out = []
        for i, k in enumerate(stops.ends):
            if k <= 0:  # no proposal: keep only the context (or what it held, sitting out)
                kvcache.set_length(self.cache, i, bases[i] if out_of_round[i] else self._base[i])
                out.append(Proposal.empty(self.device))
            else:
                sampled_row = kinds[i] is ProposalKind.SAMPLED
                out.append(Proposal.chain(drafted[i, :k], kinds[i], stacked[i, :k] if sampled_row else None))
        return out

    def observe(self, row: int, path: list[int]) -> None:
        """The first len(path) drafted tokens were committed: keep those that were fed."""
        kvcache.set_length(self.cache, row, self._base[row] + min(len(path), self._fed[row]))

    def _catch_up(self, contexts: list[list[int]], ks: list[int]) -> None:
        """Feed a row that is to draft, alone, what it has not seen but its last CATCH_UP tokens
        (a new row's prompt, the tokens of rounds it drafted nothing in): padded into the batched
        first step, a long span would cost every row its width. With other rows, at most
        `catch_up_chunk` tokens a round."""
        chunk = self.catch_up_chunk if len(contexts) > 1 else 0
        for row, (context, length, k) in enumerate(zip(contexts, self.cache.lengths, ks)):
            length += self._start[row]  # where the row's unseen tokens begin in its sequence
            end = len(context) - CATCH_UP
            if k > 0 and end > length:
                end = min(end, length + chunk) if chunk else end
                rows = slice(row, row + 1) if self.cache.rows > 1 else None
                kvcache.forward(
                    self.steps.call,
                    self.cache,
                    embeddable(torch.tensor([context[length:end]]), self.vocab).to(self.device),
                    keep=1,
                    rows=rows,
                    full_view=self.steps.mode == "inductor",
                )
                if self._start[row] == 0:  # rows joining meanwhile copy it
                    self.prefixes.save(self.cache, row, context)

    def _first_step(self, new: list[list[int]], width: int) -> torch.Tensor:
        """Feed each row's unseen tokens; the logits after each row's last one [rows, V]. Rows of
        one width need only the last position's logits (the head is a large product)."""
        count = len(new)
        ids = torch.zeros(count, width, dtype=torch.long)
        for i, tokens in enumerate(new):
            ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        ids = embeddable(ids, self.vocab)
        if all(len(tokens) == width for tokens in new):
            logits = self.steps.forward(self.cache, ids.to(self.device), keep=1)
            return logits[:, -1, : self.vocab]
        # both copies before the forward is queued (afterwards they would wait for it)
        ids = ids.to(self.device)
        last = torch.tensor([len(tokens) - 1 for tokens in new], device=self.device)
        logits = self.steps.forward(self.cache, ids)
        return logits[torch.arange(count, device=logits.device), last.to(logits.device), : self.vocab]

    def _sample(self, logits: torch.Tensor, samplings: list[SamplingConfig]):
        """When any row samples: each row's token (argmax for a greedy row) and the laws [rows, V]."""
        if len(set(samplings)) == 1:
            dist = warp(logits, samplings[0])
        else:  # rows with their own settings (a server's requests)
            dist = torch.stack([warp(logits[i], s) for i, s in enumerate(samplings)])
        token = torch.stack(
            [
                dist[i].argmax() if s.greedy else sample(dist[i], self.generators[i])
                for i, s in enumerate(samplings)
            ]
        )
        return token, dist
