"""Decoding: the engine's round loop and everything a round decides.

Start at `run.py` (the one driver: prompts -> engine events -> Stats -> outcomes), then
`engine.py` (the round: draft, verify, accept, commit; rows join and leave between rounds),
`drafters/` (one batch-first protocol: model chains, trees, prompt lookup), `verify.py` and
`acceptance.py` (the rules), `sampling.py`, `replay.py` (deterministic mode), `length.py` (how
many tokens to draft each round), `costs.py` (the device's draft length from measured costs),
`stats.py`, `events.py` and `views.py` (what a round reports, as token ids and as text). `stats`, `events` and
`views` import no torch: a client reads them alone.
"""
