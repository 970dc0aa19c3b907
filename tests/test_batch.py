"""BatchBuilder: the batched decode path builds exactly what the per-item path builds, and its
persistent rows follow every block-table change (new blocks, copy-on-write, reuse of rows)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from paged.batch import BatchBuilder
from paged.block_manager import BlockManager
from paged.sampling import SamplingParams
from paged.scheduler import ScheduledSeq
from paged.sequence import Sequence

B = 4  # block size
PAGES = 8  # pages per sequence


def _decoder(bm: BlockManager, seq_id: int, prompt_len: int, params=None) -> Sequence:
    """A sequence whose prompt is computed and whose first sampled token is waiting to run."""
    rng = np.random.default_rng(seq_id)
    prompt = rng.integers(0, 250, prompt_len).tolist()
    params = params or SamplingParams(max_tokens=20, temperature=0.5 + seq_id, top_k=seq_id,
                                      top_p=0.9, ignore_eos=True)
    seq = Sequence(seq_id, f"r{seq_id}", prompt, prompt_len, params, seed=100 + seq_id,
                   arrival_time=0.0, sample_index=seq_id % 3)
    assert bm.allocate(seq_id, prompt) is not None
    bm.mark_computed(seq_id, prompt_len)
    seq.num_computed_tokens = seq.num_slots = prompt_len
    seq.token_ids.append(int(rng.integers(0, 250)))
    return seq


def _advance(bm: BlockManager, seqs: list[Sequence]) -> tuple[list[int], list]:
    """The scheduler's half of a decode step: one slot per sequence. Returns (tokens, copies)."""
    tokens = [s.token_ids[s.num_computed_tokens] for s in seqs]
    copies = bm.append_decode_slots([s.seq_id for s in seqs], tokens)
    assert copies is not None
    for s in seqs:
        s.num_slots += 1
    return tokens, copies


def _finish_step(bm: BlockManager, seqs: list[Sequence], new_token: int = 7) -> None:
    for s in seqs:
        s.num_computed_tokens += 1
        bm.mark_computed(s.seq_id, s.num_computed_tokens)
        s.token_ids.append(new_token)


def _leaves(batch) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(batch.device)]


@pytest.mark.parametrize("lens", [[3, 4, 5, 8, 9, 13], [1], list(range(1, 21))])
def test_decode_path_equals_item_path(lens):
    bm = BlockManager(128, B, debug=True)
    seqs = [_decoder(bm, i, n) for i, n in enumerate(lens)]
    tokens, _ = _advance(bm, seqs)
    fast = BatchBuilder(bm, B, PAGES, debug=True).build([], seqs, tokens)
    for s in seqs:
        s.row = -1  # a second builder: fresh rows
    slow = BatchBuilder(bm, B, PAGES, debug=True).build([ScheduledSeq(s, 1) for s in seqs])
    assert (fast.num_tokens, fast.num_seqs, fast.num_decode) == (len(lens), len(lens), len(lens))
    for a, b in zip(_leaves(fast), _leaves(slow), strict=True):
        np.testing.assert_array_equal(a, b)
    # Sample slot i of the decode path is sequence i's, one sample each.
    assert slow.samples == [(s, i, 1) for i, s in enumerate(seqs)] and fast.samples == []


def test_rows_follow_new_blocks_across_steps():
    bm = BlockManager(128, B, debug=True)
    seqs = [_decoder(bm, i, n) for i, n in enumerate([2, 3, 4, 5])]
    builder = BatchBuilder(bm, B, PAGES, debug=True)  # debug: every row is checked against bm
    for _ in range(2 * B + 1):  # every sequence crosses at least two block boundaries
        tokens, copies = _advance(bm, seqs)
        batch = builder.build([], seqs, tokens, bool(copies))
        pages = batch.device.md.page_indices
        for i, s in enumerate(seqs):
            assert pages[i, :len(bm.block_table(s.seq_id))].tolist() == bm.block_table(s.seq_id)
        _finish_step(bm, seqs)
    assert builder.num_rows_in_use == len(seqs)


def test_copy_on_write_refreshes_rows_and_a_stale_row_is_caught():
    bm = BlockManager(128, B, debug=True)
    parent = _decoder(bm, 0, 6)  # 6 tokens: the tail block is half full
    builder = BatchBuilder(bm, B, PAGES, debug=True)
    builder.build([], [parent], _advance(bm, [parent])[0])
    _finish_step(bm, [parent])
    child = Sequence(1, "r0", list(parent.token_ids), 6, parent.params, seed=100, arrival_time=0.0,
                     sample_index=1, num_computed_tokens=parent.num_computed_tokens,
                     num_slots=parent.num_slots)
    bm.fork(0, 1)
    tokens, copies = _advance(bm, [parent, child])
    assert copies, "both write into the shared tail: one must copy it"
    # Without the refresh the parent's row still names the shared page: the debug check sees it.
    with pytest.raises(AssertionError, match="stale batch row"):
        builder.build([], [parent, child], tokens, copies=False)
    batch = builder.build([], [parent, child], tokens, copies=True)
    pages = batch.device.md.page_indices
    assert pages[0, 1] != pages[1, 1]  # the tails differ now, the head block is still shared
    assert pages[0, 0] == pages[1, 0]


def test_rows_are_released_reused_and_grow():
    bm = BlockManager(256, B)
    seqs = [_decoder(bm, i, 3) for i in range(40)]  # more than the initial 16 rows
    builder = BatchBuilder(bm, B, PAGES, debug=True)
    builder.build([], seqs, _advance(bm, seqs)[0])
    assert sorted(s.row for s in seqs) == list(range(40))
    gone = seqs[5]
    builder.release(gone)
    assert gone.row == -1 and builder.num_rows_in_use == 39
    _finish_step(bm, seqs)
    newcomer = _decoder(bm, 99, 5)
    rest = seqs[:5] + seqs[6:] + [newcomer]
    batch = builder.build([], rest, _advance(bm, rest)[0])
    assert newcomer.row == 5  # the released row is handed out again...
    np.testing.assert_allclose(  # ...with the newcomer's own sampling parameters
        batch.device.temperature[len(rest) - 1], newcomer.params.temperature)
    assert batch.device.seed[len(rest) - 1] == newcomer.seed


def test_stop_candidates():
    eos = 257
    bm = BlockManager(128, B)
    kinds = [
        SamplingParams(max_tokens=50, ignore_eos=True),  # 0: never stops here
        SamplingParams(max_tokens=50),  # 1: stops on EOS
        SamplingParams(max_tokens=50, ignore_eos=True, stop_token_ids=(3,)),  # 2: has stop ids
        SamplingParams(max_tokens=2, ignore_eos=True),  # 3: length after its second token
        SamplingParams(max_tokens=50, ignore_eos=True),  # 4: hits max_model_len
    ]
    seqs = [_decoder(bm, i, 5 if i != 4 else 8, params=p) for i, p in enumerate(kinds)]
    builder = BatchBuilder(bm, B, PAGES, max_model_len=10, eos_id=eos)
    batch = builder.build([], seqs, _advance(bm, seqs)[0])
    # After this step each holds prompt + 2 tokens: 7, except #4 with 10 = max_model_len.
    assert builder.stop_candidates(batch, [eos, 1, 1, 1, 1]) == [2, 3, 4]
    assert builder.stop_candidates(batch, [eos, eos, 1, 1, 1]) == [1, 2, 3, 4]
    assert builder.stop_candidates(batch, [1, eos, 1, 1, eos]) == [1, 2, 3, 4]
