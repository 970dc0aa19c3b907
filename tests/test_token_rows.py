"""The block manager's token log as rows of one int64 array (`paged.kv.blocks.token_rows`): the
decode calls take the engine's arrays and give the state that lists give, the key bytes are the
packed bytes of before, rows grow without losing content, and ``-1`` is never a user's token."""

from __future__ import annotations

import random

import numpy as np
import pytest

from paged.kv.block_manager import BlockManager
from paged.kv.blocks import tables
from paged.kv.blocks.prefix_index import pack_tokens

B = 4


def _state(bm: BlockManager, ids) -> tuple:
    return ([bm.block_table(s) for s in ids], [bm.num_computed_tokens(s) for s in ids],
            [bm._tables.get(s).tokens for s in ids], bm.stats())


def _prompts(bm: BlockManager, rng: random.Random, num_seqs: int, vocab: int) -> list[str]:
    """``num_seqs`` sequences with random computed prompts of 1-11 tokens below ``vocab``."""
    ids = [f"s{i}" for i in range(num_seqs)]
    for s in ids:
        p = [rng.randrange(1, vocab) for _ in range(rng.randint(1, 11))]
        bm.allocate(s, p)
        bm.mark_computed(s, len(p))
    return ids


def _run(arrays: bool, seed: int) -> tuple:
    """Random decode steps (some token ids unknown, filled in later), as lists or as arrays."""
    rng = random.Random(seed)
    bm = BlockManager(400, B, debug=True)
    ids = _prompts(bm, rng, 9, 60)
    for _ in range(30):
        n0 = [bm.num_tokens(s) for s in ids]
        new = [rng.randrange(60) for _ in ids]
        unknown = [rng.random() < 0.3 for _ in ids]
        if arrays:
            assert bm.append_decode_slots(ids, np.array(new, np.int32), np.array(unknown)) == []
        else:
            assert bm.append_decode_slots(ids, [None if u else t for t, u in
                                                zip(new, unknown)]) == []
        step = bm.begin_step()
        late = [i for i, u in enumerate(unknown) if u]
        pos, toks = [n0[i] for i in late], [new[i] for i in late]
        if arrays:
            bm.set_tokens([ids[i] for i in late], np.array(pos), np.array(toks, np.int32))
        else:
            bm.set_tokens([ids[i] for i in late], pos, toks)
        bm.step_completed(step)
        full = [i for i in range(len(ids)) if (n0[i] + 1) % B == 0]
        counts = [n0[i] + 1 for i in full]
        bm.mark_computed_many([ids[i] for i in full], np.array(counts) if arrays else counts)
    return _state(bm, ids)


@pytest.mark.parametrize("seed", range(4))
def test_arrays_give_the_state_lists_give(seed):
    assert _run(True, seed) == _run(False, seed)


def test_key_bytes_are_the_packed_token_ids():
    bm = BlockManager(64, B)
    prompt = [3, 2**40, 7, 0, 9, 2**63 - 1, 5, 1, 8]
    bm.allocate("a", prompt)
    bm.mark_computed("a", len(prompt))
    keys = bm._tables.get("a").keys
    assert [k.data for k in keys] == [pack_tokens(prompt[i * B:(i + 1) * B]) for i in range(2)]
    bm.allocate("b", prompt)  # a hit on both full blocks
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]


def test_rows_grow_and_are_reused():
    bm = BlockManager(2000, B, debug=True)
    rng = random.Random(0)
    want = {}
    for i in range(40):  # more rows than the first capacity
        p = [rng.randrange(100) for _ in range(rng.randint(1, 5))]
        bm.allocate(i, p)
        want[i] = p
    for i in range(0, 40, 3):
        bm.free(i)
        del want[i]
    long = [rng.randrange(100) for _ in range(700)]  # wider than the first width
    assert bm.append_slots(1, long) == []
    want[1] += long
    bm.allocate("new", [1, 2, 3])  # a released row, cleared
    want["new"] = [1, 2, 3]
    assert {s: bm._tables.get(s).tokens for s in want} == want


def _two_seqs(**kw) -> tuple[BlockManager, tuple]:
    """A manager holding sequences "a" and "b" (3 computed tokens each), and its state."""
    bm = BlockManager(64, B, **kw)
    for s in ("a", "b"):
        bm.allocate(s, [1, 2, 3])
        bm.mark_computed(s, 3)
    return bm, _state(bm, ["a", "b"])


@pytest.mark.parametrize("bad", [[-1, 2], np.array([-1, 2]), [1.0, 2], [2**63, 1]])
def test_bad_token_ids_raise_before_any_change(bad):
    bm, before = _two_seqs(debug=True)
    with pytest.raises(ValueError):
        bm.append_decode_slots(["a", "b"], bad)
    assert _state(bm, ["a", "b"]) == before
    with pytest.raises(ValueError):  # a -1 is no unknown: None (or the mask) is
        bm.append_slots("a", [-1])
    with pytest.raises(ValueError):
        bm.run_decode_steps(["a", "b"], np.array([[1], [-1]]))
    assert _state(bm, ["a", "b"]) == before


def _fast_run(seed: int, num_seqs: int) -> tuple:
    """Decode steps on the fast path (debug off, prefix caching on; some ids unknown, arrays
    and lists alternating), filled blocks marked and keyed, some sequences leaving and coming."""
    rng = random.Random(seed)
    bm = BlockManager(60 * num_seqs, B, enable_prefix_caching=True)
    ids = _prompts(bm, rng, num_seqs, 9)
    for j in range(24):
        n0 = [bm.num_tokens(s) for s in ids]
        new = [rng.randrange(9) for _ in ids]
        unknown = [rng.random() < 0.2 for _ in ids]
        if j % 3 == 0:
            assert bm.append_decode_slots(ids, np.array(new, np.int32), np.array(unknown)) == []
        elif j % 3 == 1:
            assert bm.append_decode_slots(ids, [None if u else t for t, u in
                                                zip(new, unknown)]) == []
        else:
            unknown = [False] * len(ids)
            assert bm.append_decode_slots(ids, np.array(new)) == []
        late = [i for i, u in enumerate(unknown) if u]
        if late:
            bm.set_tokens([ids[i] for i in late], [n0[i] for i in late], [new[i] for i in late])
        bm.step_completed(bm.begin_step())
        bm.mark_computed_many(ids, [n + 1 for n in n0])
        if j % 7 == 6:  # one leaves, a new one comes (a released row reused)
            bm.free(ids.pop(0))
            ids.append(f"n{j}")
            bm.allocate(ids[-1], [rng.randrange(1, 9) for _ in range(rng.randint(1, 6))])
            bm.mark_computed(ids[-1], bm.num_tokens(ids[-1]))
    rows = bm._tables.rows
    return _state(bm, ids), [bm._tables.get(s).unknown for s in ids], rows.n.tolist(), \
        [bm._tables.get(s).room for s in ids]


@pytest.mark.parametrize("seed,num_seqs", [(0, 3), (1, 12), (2, 16), (3, 5)])
def test_small_batches_give_the_state_the_array_path_gives(seed, num_seqs, monkeypatch):
    few = _fast_run(seed, num_seqs)  # batches of at most FEW rows: the Python pass
    monkeypatch.setattr(tables, "FEW", 0)  # every batch on the array path
    assert _fast_run(seed, num_seqs) == few


@pytest.mark.parametrize("bad", [[-1, 2], np.array([-1, 2]), [1.0, 2], [2**63, 1],
                                 np.array([2**63, 1], np.uint64), [1, 2, 3]])
def test_small_batch_bad_ids_raise_before_any_change(bad):
    bm, before = _two_seqs(enable_prefix_caching=True)  # on the fast path
    with pytest.raises(ValueError):
        bm.append_decode_slots(["a", "b"], bad)
    with pytest.raises(ValueError):
        bm.append_decode_slots(["a", "b"], np.array([5, -1]), np.array([True, False]))
    assert _state(bm, ["a", "b"]) == before
