"""A draft model reads at most a window of a long prompt (drafters/model.py, WINDOW): its last
tokens, numbered from 0. Proposals change, the output never does."""

from __future__ import annotations

import torch
from test_engine import engine_for, reference_greedy, run

from specgen.config import Method, SamplingConfig
from specgen.decoding.drafters.model import WINDOW, ChainDrafter
from specgen.runtime.prefixes import PrefixStore

LONG = [257, *range(70, 110), 198, 84, 82, 68, 81, 198, 71, 127, 102, 258, 198, 257, 64]  # 55 tokens
GREEDY = SamplingConfig(temperature=0.0)


def test_a_windowed_draft_gives_plain_decodings_output(tiny_pair):
    target, draft = tiny_pair
    reference = reference_greedy(target.model, LONG, 30)
    drafter = ChainDrafter(draft.model, draft.device, window=8)
    out, rounds = run(
        engine_for(tiny_pair, drafter), LONG, method=Method.CHAIN, max_new_tokens=30, draft_tokens=4
    )
    assert out == reference
    assert sum(len(r.draft_tokens) for r in rounds) > 0
    # the draft read the prompt's last 8 tokens and what followed, not the prompt
    assert drafter._start[0] == len(LONG) - 8
    assert drafter.cache.lengths[0] <= 8 + len(out)


def test_the_window_proposes_what_a_draft_given_only_those_tokens_proposes(tiny_pair):
    """Rotary positions: the last 8 tokens numbered from 0 draft as that text alone does."""
    _, draft = tiny_pair
    windowed = ChainDrafter(draft.model, draft.device, window=8)
    alone = ChainDrafter(draft.model, draft.device, window=0)
    windowed.join(0, LONG, None, 128)
    alone.join(0, LONG[-8:], None, 128)
    a = windowed.propose([LONG], [5], [GREEDY])[0]
    b = alone.propose([LONG[-8:]], [5], [GREEDY])[0]
    assert torch.equal(a.tokens, b.tokens)


def test_short_prompts_and_prompts_a_prefix_store_keeps_are_read_whole(tiny_pair):
    _, draft = tiny_pair
    assert ChainDrafter(draft.model, torch.device("cpu")).window == WINDOW
    short = ChainDrafter(draft.model, draft.device, window=64)
    short.join(0, LONG, None, 128)
    short.propose([LONG], [3], [GREEDY])
    assert short._start[0] == 0 and short.cache.lengths[0] >= len(LONG) - 4
    # a store that keeps prefixes (a server's): read whole, stored, and copied by the next row
    store = PrefixStore(budget=1 << 24)
    first = ChainDrafter(draft.model, draft.device, prefixes=store, window=8)
    first.join(0, LONG, None, 128)
    first.propose([LONG], [3], [GREEDY])
    assert first._start[0] == 0 and first.cache.lengths[0] >= len(LONG) - 4
    first.finished(0, LONG)
    again = ChainDrafter(draft.model, draft.device, prefixes=store, window=8)
    again.join(0, LONG + [5, 6], None, 128)
    assert again._start[0] == 0 and again.cache.lengths[0] >= len(LONG) - 4


def test_a_windowed_row_rewinds_within_its_stretch(tiny_pair):
    _, draft = tiny_pair
    drafter = ChainDrafter(draft.model, draft.device, window=8)
    drafter.join(0, LONG, None, 128)
    drafter.propose([LONG], [3], [GREEDY])
    start = drafter._start[0]
    drafter.rewind(0, start + 3)
    assert drafter.cache.lengths[0] == 3
    drafter.rewind(0, start - 5)  # before the window: nothing of it stands
    assert drafter.cache.lengths[0] == 0
    # it reads from its start again, and proposes as it did
    again = drafter.propose([LONG], [3], [GREEDY])[0]
    fresh = ChainDrafter(draft.model, draft.device, window=8)
    fresh.join(0, LONG, None, 128)
    assert torch.equal(again.tokens, fresh.propose([LONG], [3], [GREEDY])[0].tokens)
