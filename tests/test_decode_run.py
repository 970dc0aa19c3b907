"""`BlockManager.run_decode_steps` leaves the state that the same decode steps made one at a time
leave: block ids, refcounts, free-queue and LRU order, quarantine releases, keys, counters and the
blocks reported to ``on_free``; and it refuses bad calls before touching anything."""

from __future__ import annotations

import random

import numpy as np
import pytest

from paged.kv.block_manager import BlockManager

B = 4


def _build(seed: int, *, debug: bool, quarantine: int, fork: bool):
    """A manager in a random steady state: shared prefixes (hits), cached and quarantined blocks
    from finished sequences, some decoding done; the live sequences all fully computed."""
    rng = random.Random(seed)
    freed = []
    bm = BlockManager(rng.randint(24, 40), B, quarantine_steps=quarantine, debug=debug,
                      on_free=freed.append)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(3, 10))] for _ in range(3)]
    live = []
    for i in range(rng.randint(3, 7)):
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 6))]
        sid = f"s{i}"
        if bm.allocate(sid, prompt) is None:
            break
        bm.step_completed(bm.begin_step())
        bm.mark_computed(sid, len(prompt))
        live.append(sid)
    for _ in range(rng.randint(0, 6)):  # some decode steps, the stepping way
        _reference_step(bm, live, [rng.randrange(50) for _ in live])
    while fork and live and bm.num_tokens(live[0]) % B:
        _reference_step(bm, live, [rng.randrange(50) for _ in live])
    if fork and live:  # a full shared tail: no copy ahead
        bm.fork(live[0], "fork")  # (a forked sequence is off the decode fast path)
        live.append("fork")
    for sid in list(live):  # finish some: their blocks go to the LRU, the free queue or quarantine
        if len(live) > 2 and rng.random() < 0.3:
            bm.begin_step()
            bm.free(sid)
            live.remove(sid)
            bm.step_completed(bm.last_begun_step)
    if rng.random() < 0.5:  # a free while the fence window is open: quarantined across the run
        extra = "late"
        if bm.allocate(extra, [rng.randrange(50) for _ in range(5)]) is not None:
            bm.step_completed(bm.begin_step())
            bm.mark_computed(extra, 5)
            bm.free(extra)
    return bm, live, freed


def _reference_step(bm: BlockManager, ids: list, tokens: list) -> None:
    """One serial decode step as the engine drives it (append, launch, complete, readback)."""
    assert bm.append_decode_slots(ids, tokens) == []
    bm.step_completed(bm.begin_step())
    full = [s for s in ids if bm.num_tokens(s) % B == 0]
    if full:
        bm.mark_computed_many(full, [bm.num_tokens(s) for s in full])


def _key(key):
    return None if key is None else (key.digest, key.prefix_token_ids(), key.salt)


def _state(bm: BlockManager, freed: list):
    seqs = {sid: (bm.block_table(sid), bm.num_tokens(sid), bm.num_computed_tokens(sid),
                  [_key(bm.block_key(b)) for b in bm.block_table(sid)],
                  bm._tables.seqs[sid].room, bm._tables.seqs[sid].key_at)
            for sid in bm.seq_ids()}
    blocks = [(bm.block_state(b), bm.refcount(b), bm.block_version(b), _key(bm.block_key(b)))
              for b in range(bm.num_blocks)]
    return (bm.stats(), seqs, blocks, bm.evictable_blocks(), list(bm._pool.free),
            bm.last_begun_step, bm.last_completed_step, [list(f) for f in freed])


@pytest.mark.parametrize("debug", [False, True])
def test_a_run_equals_its_steps_one_at_a_time(debug):
    checked = 0
    for seed in range(80):
        quarantine = seed % 4  # 0: no quarantine window (the quiet one-take paths)
        fork = seed % 4 == 0
        a, ids, freed_a = _build(seed, debug=debug, quarantine=quarantine, fork=fork)
        b, ids_b, freed_b = _build(seed, debug=debug, quarantine=quarantine, fork=fork)
        assert ids == ids_b and _state(a, freed_a) == _state(b, freed_b)
        if not ids:
            continue
        rng = random.Random(1000 + seed)
        m = rng.randint(1, 3 * B + 2)
        rows = [[rng.randrange(50) for _ in range(m)] for _ in ids]
        if seed % 5 == 0:  # the same tokens in every row: equal keys where prompts are equal
            rows = [list(rows[0]) for _ in ids]
        ok = a.run_decode_steps(ids, np.array(rows) if seed % 2 else rows)
        if not ok:  # short: nothing changed (checked below); the steps would need more blocks
            assert _state(a, freed_a) == _state(b, freed_b)
            continue
        for j in range(m):
            _reference_step(b, ids, [row[j] for row in rows])
        assert _state(a, freed_a) == _state(b, freed_b), seed
        checked += 1
    assert checked >= 55


def test_a_short_pool_changes_nothing():
    bm = BlockManager(4, B, debug=True)  # 3 usable blocks
    bm.allocate("a", [1, 2, 3])
    bm.step_completed(bm.begin_step())
    bm.mark_computed("a", 3)
    before = _state(bm, [])
    assert bm.run_decode_steps(["a"], [list(range(3 * B))]) is False  # takes 3 more blocks
    assert _state(bm, []) == before
    assert bm.run_decode_steps(["a"], [list(range(2 * B + 1))]) is True
    assert bm.num_tokens("a") == 3 + 2 * B + 1 and bm.num_computed_tokens("a") == 3 * B


def test_bad_calls_raise_before_any_change():
    bm = BlockManager(32, B, debug=True)
    for sid in ("a", "b"):
        bm.allocate(sid, [1, 2, 3, 4, 5, 6])
    bm.step_completed(bm.begin_step())
    bm.mark_computed_many(["a", "b"], [6, 6])
    before = _state(bm, [])
    bad = [
        (["a", "zz"], [[1], [2]], "unknown sequence"),
        (["a", "a"], [[1], [2]], "repeated"),
        (["a", "b"], [[1, 2], [3]], "same number of steps"),
        (["a", "b"], [[1], [None]], "known token ids"),
        (["a", "b"], [[1], [-1]], r"\[0, 2\*\*63\)"),
        (["a"], [[1], [2]], "1 sequence ids but 2 rows"),
        ("a", [[1]], "list of sequence ids"),
        (["a", "b"], np.array([[1], [-2]]), r"\[0, 2\*\*63\)"),
        (["a", "b"], np.array([[1, 2]]), "2 sequence ids but 1 rows"),
        (["a"], 5, "one sequence of token ids"),
    ]
    for ids, rows, msg in bad:
        with pytest.raises(ValueError, match=msg):
            bm.run_decode_steps(ids, rows)
        assert _state(bm, []) == before
    bm.fork("a", "c")  # a's partly filled tail is shared now: the next append copies it
    before = _state(bm, [])
    with pytest.raises(ValueError, match="shared"):
        bm.run_decode_steps(["a"], [[7]])
    assert _state(bm, []) == before


def test_quiet_runs_equal_their_steps():
    # No quarantine window: the blocks are taken at once and the filled rows keyed in one call
    # per round of B steps; equal rows make equal keys (shared prompts), whose first-wins order
    # must be the steps' own.
    checked = 0
    for seed in range(120):
        fork = seed % 6 == 0
        a, ids, freed_a = _build(seed, debug=False, quarantine=0, fork=fork)
        b, _, freed_b = _build(seed, debug=False, quarantine=0, fork=fork)
        if not ids:
            continue
        rng = random.Random(2000 + seed)
        m = rng.randint(1, B) if seed % 3 else rng.randint(B + 1, 3 * B + 2)
        rows = [[rng.randrange(50) for _ in range(m)] for _ in ids]
        if seed % 2:
            rows = [list(rows[0]) for _ in ids]
        if a.run_decode_steps(ids, np.array(rows)):
            for j in range(m):
                _reference_step(b, ids, [row[j] for row in rows])
            checked += 1
        assert _state(a, freed_a) == _state(b, freed_b), seed
    assert checked >= 80


def test_equal_keys_keep_the_steps_first_wins_order():
    # Equal prompts and equal decoded tokens: blocks filled in one step by several rows, and in
    # later steps by others, get equal keys; the first keyed (step order, then row order) is
    # indexed, the others adopt its key.
    for m in range(1, 3 * B + 2):
        for lens in ([3, 3, 2, 3], [2, 3, 3, 1], [1, 2, 3, 3]):
            mgrs = []
            for _ in range(2):
                bm = BlockManager(40, B, quarantine_steps=0)
                ids = []
                for i, n in enumerate(lens):
                    sid = f"s{i}"
                    bm.allocate(sid, [7, 8, 9][:n])
                    bm.step_completed(bm.begin_step())
                    bm.mark_computed(sid, n)
                    ids.append(sid)
                mgrs.append((bm, ids))
            (a, ids), (b, _) = mgrs
            full = [7, 8, 9] + [5] * (4 * B)
            rows = [full[n:n + m] for n in lens]
            assert a.run_decode_steps(ids, np.array(rows))
            for j in range(m):
                _reference_step(b, ids, [row[j] for row in rows])
            assert _state(a, []) == _state(b, []), (m, lens)
