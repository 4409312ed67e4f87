"""Suffix memory: drafts copied from what earlier requests' prompts and outputs contained.

A memory per target model keeps the committed text of every request (its prompt, then its output as
it is generated) and proposes, for a context, what followed the longest earlier occurrences of the
context's tail, as SuffixDecoding (Arctic Inference) and llama.cpp's lookup caches do. A draft costs
no forward; the target verifies it, so the memory decides speed, never correctness.

Drafting. Every position p of a document with `min_match` tokens before it is indexed by a hash of
those tokens (a hash chain, as in zlib: `head[h]` is the newest position with hash h, `prev[p]` the
one before it). A query walks the chain newest first (at most CANDIDATES matching positions and
CHAIN_STEPS steps per query), extends each match backwards (at most `max_depth` tokens) and keeps the
deepest ones. The draft grows token by token: the most frequent next token among the candidates that
still agree with it; the fraction of them backing it multiplies a running probability, and drafting
stops below MIN_PROB, at k, at MAX_DRAFT or at ALPHA x the match depth. A candidate in the caller's
own live document (`exclude`) that reaches that document's end continues with the draft itself, a
periodic copy as in LZ77, so text stuck in a loop is drafted whole. Cost: O(candidates x (depth + k)),
never the memory's size; extend is O(tokens appended) (amortised over segments).

Layout. Text lives in segments, oldest first; each is three preallocated int32 arrays of `cap` slots
(tokens, chain links, chain heads: SLOT_BYTES = 12 per slot). A slot of `tok` holds a token (>= 0),
-1 (a stop: the start of a new document, or the end of a run another document interrupted), a link
(-2 - target: a run continuing at or continued from position target, always a token) or a mark
(LINK_FLOOR - c: a run starting with a c-token copy of its document's tail in an older segment,
so that matches cross the boundary; copies are not indexed, nor counted in `tokens`). Streams that
write in turn thus stay logically contiguous at the cost of two slots per switch.

Invariants. nbytes <= budget at all times: whole segments (SEG_OVERHEAD + 12 x cap) plus the
document records (DOC_BYTES each, at most budget / DOC_SHARE of them, least recently extended
dropped first), constants measured with tracemalloc with a margin. When a new segment would not
fit, the oldest segments are dropped whole; a segment is at most 1/SEGMENTS of the budget. Every
indexed position holds a token and has min_match tokens before it; chains point to smaller positions.
One lock serialises extend, draft and a save (runtime/suffix_file.py: the file format).
"""

from __future__ import annotations

import heapq
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

MAX_DRAFT = 32  # the most tokens one draft may hold
MIN_PROB = 0.3  # drafting stops when the running product of support fractions falls below this
ALPHA = 4  # a draft is at most ALPHA x the match depth long (SuffixDecoding's max_spec factor)
CANDIDATES = 64  # matching positions examined per draft, newest first
CHAIN_STEPS = 256  # chain entries walked per draft (hash collisions included)
SEGMENTS = 8  # a segment holds at most 1/SEGMENTS of the budget: what one eviction drops
START_SEG = 4096  # slots of the first segment; each next one doubles up to the budget's share
SLOT_BYTES = 12  # token + chain link + chain head, int32 each
SEG_OVERHEAD = 512  # a segment's objects besides its buffers (measured: ~435 bytes)
DOC_BYTES = 320  # a document record with its dict entry (measured: ~175-215 bytes)
DOC_SHARE = 16  # document records use at most budget / DOC_SHARE
BASE_BYTES = 4096  # the memory's own objects (measured: ~1 KiB)
MAX_CAP = 1 << 30  # slots per segment (links encode positions below it)
LINK_FLOOR = -(MAX_CAP + 1)  # values in [LINK_FLOOR, -2] are links, below it marks


class SuffixFileError(Exception):
    """A suffix-memory file that cannot be used; the message is one line naming the file and why."""


@dataclass(frozen=True)
class Continuation:
    """A draft: a tree of tokens, node j >= 1 being tokens[j - 1] with parent parents[j - 1]
    (node 0 is the context's end); a chain, each token the child of the one before, by default."""

    tokens: list[int]  # the drafted tokens, at most k (and at most MAX_DRAFT)
    depth: int  # how many tokens of the context's tail matched
    count: int  # how many earlier occurrences backed the first token
    parents: tuple[int, ...] = ()  # each node's parent; given empty, the chain's

    def __post_init__(self) -> None:
        if not self.parents:
            object.__setattr__(self, "parents", tuple(range(len(self.tokens))))


class Segment:
    __slots__ = ("cap", "n", "tok", "prev", "head", "last", "tokens")

    def __init__(self, cap: int):
        self.cap, self.n, self.last, self.tokens = cap, 0, None, 0
        self.tok = array("i", [0]) * cap  # exact allocations (array repetition does not over-allocate)
        self.prev = array("i", [-1]) * cap
        self.head = array("i", [-1]) * cap

    @property
    def nbytes(self) -> int:
        return SEG_OVERHEAD + SLOT_BYTES * self.cap


class _Doc:
    __slots__ = ("seg", "end", "pending")

    def __init__(self):
        self.seg, self.end, self.pending = None, -1, -1  # pending: its interrupted run's stop slot


def swapped(a: array) -> array:
    a.byteswap()
    return a


def tail_of(tok, p: int, count: int) -> list[int]:
    """Up to `count` tokens of the document before position p, oldest first (following links)."""
    out, q = [], p - 1
    while len(out) < count and q >= 0:
        v = tok[q]
        if v >= 0:
            out.append(v)
            q -= 1
        elif LINK_FLOOR <= v < -1:
            q = -2 - v
        else:
            break
    out.reverse()
    return out


def _depth(tok, p: int, tail: list[int]) -> int:
    """How many of tail's last tokens equal the document's tokens before position p."""
    d, i, q = 0, len(tail) - 1, p - 1
    while i >= 0 and q >= 0:
        v = tok[q]
        if v >= 0:
            if v != tail[i]:
                break
            d, i, q = d + 1, i - 1, q - 1
        elif LINK_FLOOR <= v < -1:
            q = -2 - v
        else:
            break
    return d


def _forward(seg: Segment, q: int) -> int:
    """The position of the document's token after position q, or -1."""
    r = q + 1
    if r >= seg.n:
        return -1
    v = seg.tok[r]
    if v >= 0:
        return r
    return -2 - v if LINK_FLOOR <= v < -1 else -1


class SuffixMemory:
    """A bounded memory of documents (one request's prompt and output each) that drafts the
    continuation of the longest, most frequent earlier occurrences of a context's tail.

    Thread-safe; see the module docstring for the layout, the costs and the invariants.
    """

    def __init__(self, budget: int, *, max_depth: int = 32, min_match: int = 2):
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise ValueError(f"the suffix memory's budget must be a positive number of bytes, got {budget!r}")
        if not 1 <= min_match <= max_depth <= 4096:
            raise ValueError(f"need 1 <= min_match <= max_depth <= 4096, got {min_match} and {max_depth}")
        self.budget, self.max_depth, self.min_match = budget, max_depth, min_match
        self._docs_cap = max(16, budget // DOC_SHARE // DOC_BYTES)
        self._area = budget - BASE_BYTES - self._docs_cap * DOC_BYTES  # for segments
        self._seg_cap = min(MAX_CAP - 1, (self._area // SEGMENTS - SEG_OVERHEAD) // SLOT_BYTES)
        if self._seg_cap < max_depth + 8:
            least = BASE_BYTES + 16 * DOC_BYTES + SEGMENTS * (SEG_OVERHEAD + SLOT_BYTES * (max_depth + 8))
            raise ValueError(f"a suffix memory's budget of {budget} bytes is too small: it needs {least}")
        self._lock = threading.Lock()
        self._segs: list[Segment] = []
        self._docs: dict[int, _Doc] = {}  # least recently extended first
        self._next = self._seg_bytes = self._tokens = 0

    @property
    def nbytes(self) -> int:
        """The accounted size: never above the budget."""
        with self._lock:
            return BASE_BYTES + self._seg_bytes + DOC_BYTES * len(self._docs)

    @property
    def tokens(self) -> int:
        """Document tokens held (copies made at segment boundaries are not counted)."""
        with self._lock:
            return self._tokens

    def open(self) -> int:
        """A new document; returns its id."""
        with self._lock:
            self._next += 1
            return self._next - 1

    def extend(self, doc: int, tokens: Sequence[int]) -> None:
        """Append committed tokens to a document; they help drafting at once, other documents too."""
        try:
            toks = array("i", tokens)
        except (OverflowError, TypeError) as e:
            raise ValueError(f"tokens must be int32 ids: {e}") from None
        if toks and min(toks) < 0:
            raise ValueError("tokens must be non-negative ids")
        with self._lock:
            if not 0 <= doc < self._next:
                raise ValueError(f"unknown document {doc!r}: ids come from open()")
            if not toks:
                return
            rec = self._docs.pop(doc, None) or _Doc()
            self._docs[doc] = rec
            if len(self._docs) > self._docs_cap:
                del self._docs[next(iter(self._docs))]
            i = 0
            while i < len(toks):
                i += self._write(rec, toks, i)

    def _write(self, rec: _Doc, toks: array, i: int) -> int:
        """Write a chunk of toks[i:] into the newest segment; returns how many tokens it took."""
        seg = self._segs[-1] if self._segs else None
        mm, pre, link = self.min_match, None, False
        if seg is not None and rec.seg is seg:  # the document's run is in the newest segment
            before = tail_of(seg.tok, rec.end + 1, mm)
            if seg.last is rec:
                pre = []
            elif rec.pending >= 0:  # its run was interrupted: link the new chunk to it, both ways
                pre, link = [-2 - rec.end], True
        term = 1 if seg is not None and seg.last is not None and seg.last is not rec else 0
        if pre is None or seg.cap - seg.n < term + len(pre) + 1:  # a new run
            tail = tail_of(rec.seg.tok, rec.end + 1, self.max_depth) if rec.seg is not None else []
            before, pre, link = tail[-mm:], ([LINK_FLOOR - len(tail)] + tail if tail else [-1]), False
            if seg is None or seg.cap - seg.n < term + len(pre) + 1:
                seg, term = self._new_segment(), 0
        tok, n = seg.tok, seg.n
        if term:  # close the interrupted run of the segment's last writer
            tok[n] = -1
            if seg.last.seg is seg:
                seg.last.pending = n
            n += 1
        if link:
            tok[rec.pending] = -2 - (n + 1)
        tok[n : n + len(pre)] = array("i", pre)
        n += len(pre)
        m = min(len(toks) - i, seg.cap - n)
        chunk = toks[i : i + m]
        tok[n : n + m] = chunk
        ctx, off = before + chunk.tolist(), len(before)
        head, prev, size = seg.head, seg.prev, len(seg.head)
        for j in range(max(0, mm - off), m):
            h = hash(tuple(ctx[off + j - mm : off + j])) % size
            prev[n + j] = head[h]
            head[h] = n + j
        seg.n, seg.last = n + m, rec
        seg.tokens += m
        self._tokens += m
        rec.seg, rec.end, rec.pending = seg, n + m - 1, -1
        return m

    def _new_segment(self) -> Segment:
        cap = min(self._seg_cap, max(START_SEG, 2 * self._segs[-1].cap) if self._segs else START_SEG)
        while self._segs and self._seg_bytes + SEG_OVERHEAD + SLOT_BYTES * cap > self._area:
            self._evict()
        seg = Segment(cap)
        self._segs.append(seg)
        self._seg_bytes += seg.nbytes
        return seg

    def _evict(self) -> None:
        """Drop the oldest segment, and the records of the documents whose run ended there."""
        seg = self._segs.pop(0)
        self._seg_bytes -= seg.nbytes
        self._tokens -= seg.tokens
        for d in [d for d, r in self._docs.items() if r.seg is seg]:
            self._docs.pop(d).seg = None

    def draft(
        self, context: Sequence[int], k: int, exclude: int | None = None, branches: int = 1
    ) -> Continuation | None:
        """The continuation of the deepest earlier occurrences of context's tail (at least min_match
        tokens), or None when that tail was never seen or no token is backed by MIN_PROB.
        `exclude`: the caller's own live document, whose end is the context's end (see module).
        `branches` > 1: a tree of at most k tokens, each node's `branches` most frequent next
        tokens grown best first by their running probability (SuffixDecoding's speculation
        tree); 1: the chain of the most frequent ones."""
        mm = self.min_match
        if k <= 0 or len(context) < mm:
            return None
        tail = [int(t) for t in context[-self.max_depth :]]
        key = hash(tuple(tail[-mm:]))
        best, cands, matched, steps = mm, [], 0, 0
        with self._lock:
            for seg in reversed(self._segs):
                p = seg.head[key % len(seg.head)]
                while p >= 0 and matched < CANDIDATES and steps < CHAIN_STEPS:
                    steps += 1
                    d = _depth(seg.tok, p, tail)
                    if d >= mm:
                        matched += 1
                        if d > best:
                            best, cands = d, [(seg, p)]
                        elif d == best:
                            cands.append((seg, p))
                    p = seg.prev[p]
            if not cands:
                return None
            rec = self._docs.get(exclude) if exclude is not None else None
            live = (rec.seg, rec.end) if rec is not None else (None, -1)
            return self._grow(cands, best, min(k, MAX_DRAFT, ALPHA * best), live, branches)

    @staticmethod
    def _grow(cands: list, depth: int, limit: int, live: tuple, branches: int = 1) -> Continuation | None:
        """Grow the draft from candidate cursors (segment, position), best first: a node's options
        are its `branches` most voted next tokens (ties to the newest candidate), each at the
        node's probability times its share of the node's votes; the likeliest option joins the
        tree until `limit` tokens or none is at MIN_PROB. A cursor (None, j) reads the j-th token
        of its node's own path (the live document continuing with the draft itself)."""
        tokens: list[int] = []
        parents: list[int] = []
        paths: list[list[int]] = [[]]  # each node's path of drafted tokens, the root's empty
        options: list = []  # a heap of (-probability, order, parent node, token, its voters)
        order = 0

        def offer(node: int, voters: list, prob: float) -> None:
            nonlocal order
            votes: dict[int, list] = {}
            for seg, q in voters:  # newest first: ties go to the newest
                votes.setdefault(paths[node][q] if seg is None else seg.tok[q], []).append((seg, q))
            ranked = sorted(votes.items(), key=lambda item: -len(item[1]))[:branches]
            for token, backers in ranked:
                share = prob * len(backers) / len(voters)
                if share >= MIN_PROB:
                    heapq.heappush(options, (-share, order, node, token, backers))
                    order += 1

        offer(0, cands, 1.0)
        first = 0
        while options and len(tokens) < limit:
            negative, _, parent, token, backers = heapq.heappop(options)
            tokens.append(token)
            parents.append(parent)
            path = paths[parent] + [token]
            paths.append(path)
            first = first or len(backers)
            nxt = []
            for seg, q in backers:
                if seg is None or (seg is live[0] and q == live[1]):
                    nxt.append((None, 0 if seg is not None else q + 1))
                elif (r := _forward(seg, q)) >= 0:
                    nxt.append((seg, r))
            if nxt:
                # shares of the node's own voters, as the chain's support: cursors that reached
                # their document's end still count in the denominator
                offer(len(tokens), nxt, -negative * len(nxt) / len(backers))
        return Continuation(tokens, depth, first, tuple(parents)) if tokens else None
