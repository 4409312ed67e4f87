"""The suffix memory (specgen.runtime.suffix.py): drafting by depth and frequency, eviction, files."""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import struct
import subprocess
import sys
import threading

import pytest

from specgen.runtime import suffix_file
from specgen.runtime.suffix import (
    MAX_DRAFT,
    Continuation,
    SuffixFileError,
    SuffixMemory,
)

MIB = 1 << 20


def memory_with(*docs, budget=MIB, **kw):
    mem = SuffixMemory(budget, **kw)
    ids = []
    for doc in docs:
        ids.append(mem.open())
        mem.extend(ids[-1], doc)
    return mem, ids


def joined(docs):
    return ["," + ",".join(map(str, doc)) + "," for doc in docs]


def occurs(needle, hay):
    """Whether needle is a contiguous run of one of the documents (`joined`)."""
    text = "," + ",".join(map(str, needle)) + ","
    return any(text in doc for doc in hay)


def interleaved(seed=0, docs=6, rounds=6000, vocab=40):
    """Documents written in turn in chunks of 1..6 tokens (runs, links and segment moves)."""
    rng = random.Random(seed)
    mem = SuffixMemory(4 * MIB)
    ids = [mem.open() for _ in range(docs)]
    texts = {d: [] for d in ids}
    for _ in range(rounds):
        d = rng.choice(ids)
        chunk = [rng.randrange(vocab) for _ in range(rng.randrange(1, 7))]
        mem.extend(d, chunk)
        texts[d] += chunk
    return mem, texts, rng


# -- drafting -------------------------------------------------------------------------------------


def test_a_repeated_passage_is_drafted_back_with_its_depth():
    passage = list(range(100, 140))
    mem, _ = memory_with([1, 2, 3] + passage + [4, 5])
    got = mem.draft([9, 9] + passage[:10], 32)
    assert got == Continuation(passage[10:] + [4, 5], depth=10, count=1)
    assert mem.tokens == 45


def test_a_longer_match_beats_a_more_recent_shorter_one():
    mem, _ = memory_with([7, 1, 2, 50, 51], [8, 1, 2, 60, 61])
    got = mem.draft([7, 1, 2], 8)
    assert got.tokens == [50, 51] and got.depth == 3
    tie = mem.draft([9, 1, 2], 8)  # both match 2 tokens, seen once each: the newest, at support 1/2
    assert tie.tokens == [60, 61] and tie.depth == 2 and tie.count == 1


def test_frequency_decides_between_continuations():
    mem, _ = memory_with(*([[5, 2, 3, 10, 11]] * 3), [5, 2, 3, 20, 21])
    got = mem.draft([5, 2, 3], 8)
    assert got.tokens == [10, 11] and got.count == 3 and got.depth == 3


def test_nothing_for_an_unseen_or_too_short_tail():
    mem, _ = memory_with([1, 2, 3, 4])
    assert mem.draft([3, 1], 8) is None
    assert mem.draft([2], 8) is None and mem.draft([], 8) is None
    assert mem.draft([1, 2], 0) is None
    deep, _ = memory_with([1, 2, 3, 4], min_match=3)
    assert deep.draft([1, 2], 8) is None and deep.draft([1, 2, 3], 8).tokens == [4]


def test_k_max_draft_and_the_depth_limit_are_respected():
    passage = list(range(1000, 1200))
    mem, _ = memory_with(passage)
    assert mem.draft(passage[:20], 5).tokens == passage[20:25]
    assert mem.draft(passage[:20], 1000).tokens == passage[20 : 20 + MAX_DRAFT]
    shallow = mem.draft([1, 1000, 1001], 1000)  # a 2-token match drafts at most 4 x 2
    assert shallow.depth == 2 and shallow.tokens == passage[2:10]


def test_exclude_continues_the_callers_own_loop_periodically():
    loop = [5, 6, 7, 5, 6, 7, 5, 6]
    mem, (d,) = memory_with(loop)
    assert mem.draft(loop, 8, exclude=d) == Continuation([7, 5, 6, 7, 5, 6, 7, 5], depth=5, count=1)
    assert mem.draft(loop, 8).tokens == [7, 5, 6]  # without it the copy stops at the document's end


def test_the_callers_own_tail_is_never_an_occurrence():
    mem, (d,) = memory_with([1, 2, 3, 4])
    assert mem.draft([1, 2, 3, 4], 8, exclude=d) is None
    e = mem.open()
    mem.extend(e, [9, 3, 4, 70, 71])
    assert mem.draft([1, 2, 3, 4], 8, exclude=d).tokens == [70, 71]


def test_a_live_stream_helps_another_document_at_once():
    passage = list(range(300, 360))
    mem = SuffixMemory(MIB)
    a, b = mem.open(), mem.open()
    mem.extend(a, passage[:20])
    mem.extend(b, [1, 2])  # another stream writes in between: a's run is interrupted and continued
    assert mem.draft(passage[:5], 32).tokens == passage[5:20]
    mem.extend(a, passage[20:40])
    assert mem.draft(passage[:5], 32).tokens == passage[5:25]  # 4 x depth 5
    assert mem.draft(passage[:10], 32).tokens == passage[10:40]


def test_a_document_continued_in_a_new_segment_still_matches_across_the_boundary():
    mem, texts, rng = interleaved()
    assert len(mem._segs) >= 3
    hay = joined(texts.values())
    for d, text in texts.items():
        for _ in range(30):
            i = rng.randrange(8, len(text) - 1)
            got = mem.draft(text[:i], 8)
            assert got is not None and got.depth >= 2
            assert occurs(text[i - got.depth : i] + got.tokens, hay)


def reference_draft(docs, stamps, context, k, exclude=None, max_depth=32, min_match=2):
    """SuffixMemory.draft by brute force over whole documents (few occurrences per key)."""
    from specgen.runtime.suffix import ALPHA, MIN_PROB

    tail = context[-max_depth:]
    found = []
    for d, doc in docs.items():
        for i in range(min_match, len(doc)):
            depth = 0
            while depth < min(i, len(tail)) and doc[i - 1 - depth] == tail[-1 - depth]:
                depth += 1
            if depth >= min_match:
                found.append((depth, stamps[d][i], d, i))
    if len(tail) < min_match or not found or k <= 0:
        return None
    best = max(f[0] for f in found)
    cands = [(d, i) for depth, _, d, i in sorted(found, key=lambda f: -f[1]) if depth == best]
    draft, prob, support, first = [], 1.0, len(cands), 0
    while len(draft) < min(k, MAX_DRAFT, ALPHA * best) and cands:
        read = [draft[i] if d is None else docs[d][i] for d, i in cands]
        votes = {t: read.count(t) for t in read}
        t = max(votes, key=votes.__getitem__)
        prob *= votes[t] / support
        if prob < MIN_PROB:
            break
        draft.append(t)
        support, first = votes[t], first or votes[t]
        nxt = []
        for (d, i), r in zip(cands, read):
            if r == t:
                if d is not None and i + 1 < len(docs[d]):
                    nxt.append((d, i + 1))
                elif d is None or d == exclude:
                    nxt.append((None, 0 if d is not None else i + 1))
        cands = nxt
    return Continuation(draft, best, first) if draft else None


def test_drafts_match_a_brute_force_reference():
    rng = random.Random(11)
    mem = SuffixMemory(MIB)
    docs = {mem.open(): [] for _ in range(5)}
    stamps = {d: [] for d in docs}
    clock = 0
    for _ in range(700):
        d = rng.choice(list(docs))
        chunk = [rng.randrange(25) for _ in range(rng.randrange(1, 5))]
        mem.extend(d, chunk)
        docs[d] += chunk
        stamps[d] += range(clock, clock + len(chunk))
        clock += len(chunk)
        ctx = docs[d][-rng.randrange(1, 40) :]
        for exclude in (None, d):
            k = rng.randrange(0, 40)
            assert mem.draft(ctx, k, exclude) == reference_draft(docs, stamps, ctx, k, exclude)
    assert len(mem._segs) == 1


# -- eviction and accounting ----------------------------------------------------------------------


def test_eviction_drops_the_oldest_text_first_within_budget():
    budget = 64 * 1024
    mem = SuffixMemory(budget)
    docs = [list(range(i * 1000, i * 1000 + 300)) for i in range(200)]
    for text in docs:
        mem.extend(mem.open(), text)
        assert mem.nbytes <= budget
    assert mem.draft(docs[0][:10], 8) is None
    assert mem.draft(docs[-1][:10], 8).tokens == docs[-1][10:18]
    assert 0 < mem.tokens < 200 * 300
    alive = [i for i, text in enumerate(docs) if mem.draft(text[50:60], 4) is not None]
    assert alive == list(range(alive[0], 200))  # a contiguous run of the newest documents


def test_many_streams_in_a_small_memory_stay_consistent():
    """More streams than document records (16 at 64 KiB) writing in turn, evicting as they go:
    every draft is still a real continuation, and the accounting never exceeds the budget."""
    budget = 64 * 1024
    mem = SuffixMemory(budget)
    rng = random.Random(9)
    texts = {mem.open(): [] for _ in range(40)}
    drafts = []
    for _ in range(3000):
        d = rng.choice(list(texts))
        chunk = [rng.randrange(30) for _ in range(rng.randrange(1, 5))]
        mem.extend(d, chunk)
        texts[d] += chunk
        assert mem.nbytes <= budget
        got = mem.draft(texts[d][-10:], 8)
        if got is not None:
            drafts.append((texts[d][-10:], got))
    assert len(mem._docs) <= 16 and len(drafts) > 1000
    hay = joined(texts.values())
    assert all(occurs(ctx[-got.depth :] + got.tokens, hay) for ctx, got in drafts)


def test_budget_is_validated():
    for bad in (0, -5, 1.5, None):
        with pytest.raises(ValueError, match="budget"):
            SuffixMemory(bad)
    with pytest.raises(ValueError, match="too small"):
        SuffixMemory(1000)
    with pytest.raises(ValueError, match="min_match"):
        SuffixMemory(MIB, min_match=0)
    mem = SuffixMemory(MIB)
    with pytest.raises(ValueError, match="unknown document"):
        mem.extend(3, [1])
    with pytest.raises(ValueError, match="non-negative"):
        mem.extend(mem.open(), [1, -2])


# -- files ----------------------------------------------------------------------------------------


def test_save_and_load_give_identical_drafts(tmp_path):
    mem, texts, rng = interleaved(seed=1)
    path = tmp_path / "suffix.bin"
    suffix_file.save(mem, path, "tokenizer-a")
    assert not os.path.exists(str(path) + ".tmp")
    back = suffix_file.load(path, "tokenizer-a", 4 * MIB)
    assert back.tokens == mem.tokens and back.nbytes <= 4 * MIB
    for _ in range(400):
        text = rng.choice(list(texts.values()))
        i = rng.randrange(2, len(text))
        ctx = text[max(0, i - 12) : i]
        assert back.draft(ctx, 16) == mem.draft(ctx, 16)
    d = back.open()  # and it keeps learning
    back.extend(d, [777, 778, 779, 780])
    assert back.draft([777, 778], 4).tokens == [779, 780]


def test_a_small_newest_segment_loads_with_the_older_ones(tmp_path):
    mem = SuffixMemory(MIB)
    d = mem.open()
    mem.extend(d, list(range(4095)))  # fills the first segment exactly (a stop slot and 4095 tokens)
    mem.extend(d, [7, 8, 9])  # a new segment: the tail copied (not counted), then 3 tokens
    assert [s.n for s in mem._segs] == [4096, 1 + 32 + 3]
    suffix_file.save(mem, tmp_path / "m", "fp")
    back = suffix_file.load(tmp_path / "m", "fp", MIB)
    assert back.tokens == mem.tokens == 4098
    assert back.draft([4093, 4094], 4).tokens == [7, 8, 9] == mem.draft([4093, 4094], 4).tokens
    assert back.draft([10, 11], 4).tokens == [12, 13, 14, 15]


def test_loading_into_a_smaller_budget_keeps_the_newest_text(tmp_path):
    mem = SuffixMemory(4 * MIB)
    docs = [list(range(i * 1000, i * 1000 + 500)) for i in range(100)]
    for text in docs:
        mem.extend(mem.open(), text)
    suffix_file.save(mem, tmp_path / "m", "fp")
    small = suffix_file.load(tmp_path / "m", "fp", 128 * 1024)
    assert small.nbytes <= 128 * 1024 and 0 < small.tokens < mem.tokens
    assert small.draft(docs[0][:10], 8) is None
    assert small.draft(docs[-1][:10], 8).tokens == docs[-1][10:18]


def expect_file_error(path, fingerprint="fp", budget=MIB):
    with pytest.raises(SuffixFileError) as info:
        suffix_file.load(path, fingerprint, budget)
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    return message


def with_digest(body: bytes) -> bytes:
    return body + hashlib.blake2b(body, digest_size=32).digest()


def test_bad_files_raise_one_line_errors(tmp_path):
    mem, _, _ = interleaved(seed=2, rounds=600)
    good = tmp_path / "good"
    suffix_file.save(mem, good, "fp")
    data = good.read_bytes()
    assert "another tokenizer" in expect_file_error(good, fingerprint="other")
    assert "cannot read" in expect_file_error(tmp_path / "missing")
    assert "cannot read" in expect_file_error(tmp_path)  # a directory
    bad = tmp_path / "bad"
    for cut in range(0, len(data), 97):
        bad.write_bytes(data[:cut])
        expect_file_error(bad)
    rng = random.Random(3)
    for _ in range(200):
        flipped = bytearray(data)
        flipped[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        bad.write_bytes(bytes(flipped))
        expect_file_error(bad)
    for size in (0, 5, 64, 4096):
        bad.write_bytes(rng.randbytes(size))
        expect_file_error(bad)
    bad.write_bytes(
        with_digest(data[:8] + struct.pack("<IIIII", 1, 32, 2, 1, 2) + b"fp" + struct.pack("<Q", 1 << 60))
    )
    assert "bad header" in expect_file_error(bad)
    bad.write_bytes(with_digest(data[:8] + struct.pack("<IIIII", 1, 32, 2, 0xFFFFFFFF, 2) + b"fp"))
    assert "bad header" in expect_file_error(bad)
    bad.write_bytes(with_digest(data[:8] + struct.pack("<IIIII", 9, 32, 2, 0, 2) + b"fp"))
    assert "format version 9" in expect_file_error(bad)


def test_bad_slots_behind_a_good_checksum_are_caught(tmp_path):
    """A file whose checksum was recomputed over garbage slots loads or fails cleanly, and what loads
    drafts without any error: no link can lead a walk out of its array."""
    mem, _, _ = interleaved(seed=4, rounds=400)
    suffix_file.save(mem, tmp_path / "good", "fp")
    body = bytearray((tmp_path / "good").read_bytes()[:-32])
    start = len(body) - 4 * mem._segs[-1].n  # the newest segment's slots
    rng = random.Random(5)
    bad = tmp_path / "bad"
    for _ in range(150):
        garbled = bytearray(body)
        for _ in range(rng.randrange(1, 6)):
            i = rng.randrange(start, len(body) - 3)
            garbled[i : i + 4] = struct.pack(
                "<i", rng.choice([rng.randrange(-(2**31), 2**31), -2, -1, -3 - i])
            )
        bad.write_bytes(with_digest(bytes(garbled)))
        try:
            loaded = suffix_file.load(bad, "fp", MIB)
        except SuffixFileError as e:
            assert str(bad) in str(e) and "\n" not in str(e)
            continue
        for _ in range(20):
            loaded.draft([rng.randrange(40) for _ in range(8)], 16)


def test_save_failure_is_a_file_error(tmp_path):
    mem, _ = memory_with([1, 2, 3])
    with pytest.raises(SuffixFileError, match="cannot write"):
        suffix_file.save(mem, tmp_path / "no-such-dir" / "m", "fp")


# -- threads --------------------------------------------------------------------------------------


def test_threads_extending_and_drafting_concurrently():
    mem = SuffixMemory(8 * MIB)
    passages = [[random.Random(p).randrange(200) for _ in range(60)] for p in range(8)]
    written: dict[int, list[int]] = {}
    drafts: list[tuple[list[int], Continuation]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(16)

    def work(seed):
        try:
            rng = random.Random(seed)
            doc = mem.open()
            text = written.setdefault(doc, [])
            barrier.wait()
            for _ in range(150):
                passage = rng.choice(passages)
                i = rng.randrange(len(passage) - 4)
                chunk = passage[i : i + rng.randrange(1, 5)] if rng.random() < 0.7 else [rng.randrange(200)]
                mem.extend(doc, chunk)
                text += chunk
                got = mem.draft(text[-12:], 8)
                if got is not None:
                    drafts.append((text[-12:], got))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert mem.tokens == sum(len(t) for t in written.values())
    assert len(drafts) > 500
    hay = joined(written.values())
    for ctx, got in drafts:
        assert 1 <= len(got.tokens) <= 8 and got.depth >= 2
        assert occurs(ctx[-got.depth :] + got.tokens, hay)


# -- memory against the allocator -----------------------------------------------------------------


GROWTH = """
import itertools, random, sys
from specgen.runtime.suffix import SuffixMemory

def resident():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

budget = int(sys.argv[1])
rng = random.Random(7)
cum = list(itertools.accumulate(1 / (r + 1) for r in range(32000)))
passages = [rng.choices(range(32000), cum_weights=cum, k=rng.randrange(20, 200)) for _ in range(50)]
pieces = [rng.choices(range(32000), cum_weights=cum, k=50) for _ in range(400)]
before = resident()
mem = SuffixMemory(budget)
worst = 0
for n in range(1000):
    doc = mem.open()
    text = []
    while len(text) < 2000:
        text += rng.choice(passages) if rng.random() < 0.2 else rng.choice(pieces)[rng.randrange(50):]
    for i in range(0, 2000, 500):
        mem.extend(doc, text[i : i + 500])
    assert mem.nbytes <= budget, (n, mem.nbytes)
    if n % 25 == 24:
        worst = max(worst, resident() - before)
assert mem.draft(passages[0][:6], 8) is not None
print(worst, mem.nbytes, mem.tokens)
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the resident set from /proc")
@pytest.mark.parametrize("budget_mib", [64, 12])
def test_the_memory_holds_no_more_than_its_budget(budget_mib):
    """1,000 documents of 2,000 tokens (Zipf-ish over 32,000 ids, with repeated passages), in a fresh
    interpreter: its resident set grows by at most the budget + 10% (at 12 MiB the memory evicts
    all along, so freed segments must go back too)."""
    budget = budget_mib * MIB
    run = subprocess.run(
        [sys.executable, "-c", GROWTH, str(budget)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    worst, nbytes, tokens = map(int, run.stdout.split())
    print(f"budget {budget_mib} MiB: grew {worst / MIB:.1f} MiB, {nbytes / tokens:.2f} bytes/token")
    assert worst <= budget * 1.1


def test_branches_grow_a_tree_of_the_most_frequent_continuations_best_first():
    """Where earlier text continued in two ways, a draft with branches holds both, the likelier
    first; with one branch it is the chain of the most frequent, as before."""
    mem = SuffixMemory(1 << 20)
    for doc in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8, 9], [1, 2, 3, 4, 5, 6]):
        mem.extend(mem.open(), doc)
    chain = mem.draft([9, 1, 2, 3], 8)
    assert chain == Continuation([4, 5, 6], depth=3, count=2) and chain.parents == (0, 1, 2)
    assert mem.draft([9, 1, 2, 3], 8, branches=1) == chain
    tree = mem.draft([9, 1, 2, 3], 8, branches=2)
    assert tree.tokens == [4, 5, 6, 7, 8, 9] and tree.parents == (0, 1, 2, 0, 4, 5)
    assert mem.draft([9, 1, 2, 3], 4, branches=2).tokens == [4, 5, 6, 7]  # the likeliest k nodes
    mem.extend(mem.open(), [1, 2, 3, 4, 5, 6])  # 7 now backs a quarter of the matches
    assert mem.draft([9, 1, 2, 3], 8, branches=2).tokens == [4, 5, 6]  # under MIN_PROB: no branch
