"""The persistent input batch and the batch builder: rows own the running sequences' token state,
move it back when a sequence leaves, condense, and build exactly what the per-item path builds;
tokens not known yet are fed from the previous step."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from paged.kv.block_manager import BlockManager
from paged.request.sampling import SamplingParams
from paged.request.sequence import UNKNOWN, Sequence
from paged.step.batch import BatchBuilder
from paged.step.input_batch import InputBatch
from paged.step.scheduler import ScheduledSeq

B = 4  # block size
PAGES = 8  # pages per sequence


def _setup(debug: bool = False):
    bm = BlockManager(64, B)
    ib = InputBatch(B * PAGES, PAGES, eos_id=257)
    return bm, ib, BatchBuilder(ib, bm, B, debug=debug)


def _decoder(bm: BlockManager, ib: InputBatch, seq_id: int, prompt_len: int) -> Sequence:
    """A running sequence whose prompt is computed and whose first sampled token waits to run."""
    rng = np.random.default_rng(seq_id)
    prompt = rng.integers(0, 250, prompt_len).tolist()
    params = SamplingParams(max_tokens=20, temperature=0.5 + seq_id, top_k=seq_id, top_p=0.9,
                            ignore_eos=True)
    seq = Sequence(seq_id, f"r{seq_id}", prompt + [int(rng.integers(0, 250))], prompt_len, params,
                   seed=100 + seq_id, arrival_time=0.0, sample_index=seq_id % 3)
    assert bm.allocate(seq_id, prompt) is not None
    bm.mark_computed(seq_id, prompt_len)
    seq.num_computed_tokens = seq.num_slots = prompt_len
    ib.add(seq)
    return seq


def _slots(bm, ib, rows):
    """The scheduler's half of a decode step: one slot per row."""
    ids = [ib.ids[r] for r in rows]
    toks = ib.tokens[rows, ib.num_computed[rows]].tolist()
    assert bm.append_decode_slots(ids, [None if t == UNKNOWN else t for t in toks]) is not None
    ib.num_slots[rows] += 1


def test_rows_own_the_token_state_and_condense():
    bm, ib, _ = _setup()
    seqs = [_decoder(bm, ib, i, 3 + i) for i in range(3)]
    before = [list(s.token_ids) for s in seqs]
    epoch = ib.epoch
    ib.remove(seqs[0])  # the last row moves into the hole
    assert ib.epoch == epoch + 1 and ib.num_rows == 2
    assert seqs[2].row == 0 and seqs[1].row == 1 and ib.ids == [2, 1]
    assert [s.token_ids for s in seqs] == before  # read through rows, or owned again
    assert seqs[0].row == -1 and seqs[0]._tokens == before[0]
    assert seqs[0].num_computed_tokens == 3 and seqs[0].num_slots == 3
    ib.add(seqs[0])
    assert seqs[0].row == 2 and seqs[0].token_ids == before[0] and seqs[0]._tokens == []
    with pytest.raises(ValueError, match="already has row"):
        ib.add(seqs[0])
    for i in range(3, 40):  # rows grow past the initial capacity
        _decoder(bm, ib, i, 2)
    assert ib.num_rows == 40 and [s.token_ids for s in seqs] == before


@pytest.mark.parametrize("lens", [(3, 4, 5), (1, 8, 2, 7)])
def test_decode_path_equals_item_path(lens):
    bm, ib, builder = _setup(debug=True)
    for i, n in enumerate(lens):
        _decoder(bm, ib, i, n)
    rows = ib.decoders()
    assert rows.tolist() == list(range(len(lens)))
    _slots(bm, ib, rows)
    fast = builder.build(rows, [], copies=False)
    items = [ScheduledSeq(s, 1) for s in ib.seqs]
    slow = builder.build(np.zeros(0, np.intp), items, copies=False)
    for a, b in zip(jax.tree_util.tree_leaves(fast.device), jax.tree_util.tree_leaves(slow.device),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    assert fast.decode_pos.tolist() == [s.num_tokens for s in ib.seqs]


def test_commit_then_unknown_tokens_are_fed():
    bm, ib, builder = _setup(debug=True)
    for i in range(3):
        _decoder(bm, ib, i, 4 + i)
    rows = ib.decoders()
    _slots(bm, ib, rows)
    first = builder.build(rows, [], copies=False)
    builder.commit(rows, first)  # dispatched: one unknown token per row
    assert (ib.tokens[rows, first.decode_pos] == UNKNOWN).all()
    assert [s.num_known_tokens for s in ib.seqs] == [s.num_tokens - 1 for s in ib.seqs]
    rows = ib.decoders()  # still decoders: their input is the unknown token
    assert rows.tolist() == [0, 1, 2]
    _slots(bm, ib, rows)
    nxt = builder.build(rows, [], copies=False)
    feed = np.asarray(nxt.device.feed)[:3]
    assert feed.tolist() == [0, 1, 2] and nxt.fed == ib.ids and nxt.fed_rows.tolist() == [0, 1, 2]
    assert nxt.fed_pos == first.decode_pos.tolist()
    # Rows that would block a decode on a table row that went stale are caught in debug mode.
    ib.table[1, 0] = 63
    ib.num_blocks[1] = int(ib.num_computed[1]) // B + 1  # looks current
    with pytest.raises(AssertionError, match="stale batch row"):
        builder.build(rows, [], copies=False)


def test_new_blocks_refresh_rows():
    bm, ib, builder = _setup(debug=True)
    seq = _decoder(bm, ib, 0, 3)  # the 4th token fills block 0; the 5th starts block 1
    for _ in range(6):
        rows = ib.decoders()
        _slots(bm, ib, rows)
        batch = builder.build(rows, [], copies=False)
        builder.commit(rows, batch)
        ib.tokens[rows, batch.decode_pos] = 7  # read back
    table = bm.block_table(seq.seq_id)
    assert len(table) == 3 and ib.table[0, :3].tolist() == table
