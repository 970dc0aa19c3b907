"""Builds one step's device batch from the input batch's rows (numpy), padded to power-of-two buckets.

Bucketing keeps the number of distinct shapes (and so XLA compilations) small: tokens, sequences
and sample slots are each rounded up to a power of two. Padding tokens write into the null page;
padding sequences have ``kv_len = 0`` and an empty query range.

A token the host does not know yet (sampled by the step still in flight) is fed on device: its
``feed`` entry names the previous step's sample slot, and the jitted step reads it from that
step's output.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import flax
import jax
import numpy as np

from paged.kv.paging import NULL_PAGE, next_pow2
from paged.models.attention import AttentionMetadata
from paged.request.sequence import UNKNOWN, Sequence
from paged.step.input_batch import HAS_STOP_IDS, LIMIT, LOGPROBS, InputBatch
from paged.step.sampling_rows import SamplingRows

MIN_TOKENS = 8  # smallest token bucket: tiny batches share one compilation


@flax.struct.dataclass
class DeviceBatch(SamplingRows):
    """Everything the jitted step reads; shapes are bucketed.

    Packed into five arrays, one per length (each is one host fill and one transfer); the named
    fields are views, on the host and inside the jitted step alike.
    """

    tok: jax.Array  # i32[4, T]: token ids, positions, slot mapping, feed (-1: the id is given)
    seq: jax.Array  # i32[2, S + 1]: kv_lens then num_seqs; cu_q_lens
    page_indices: jax.Array  # i32[S, pages_per_seq]
    smp: jax.Array  # i32[7, N] and f32[2, N]: the sampling rows (`paged.step.sampling_rows`)
    smp_f: jax.Array
    # i32[G, S + 1] shared-prefix groups of a decode-only step (paged.step.cascade_plan), or None.
    casc: jax.Array | None = None
    # i32[G - 1, T] slot mappings of KV-cache groups 1 .. G-1 (``page_indices`` then
    # interleaves the groups' tables, see paged.kv.group_manager), or None: one group.
    grp: jax.Array | None = None
    # Packed (int4 / int2) pages: the step's open-page indices
    # (paged.models.kivi_attention.KiviMeta), or None.
    kivi: object | None = None
    # f32[T] each token's weight in the attention mass (KV policies scoring by attention,
    # paged.kv.mass), or None: the step computes no mass.
    mw: jax.Array | None = None
    # i32[L, S, 2] per layer and sequence, slots [lo, hi) the layer does not see (a KV policy's
    # per-layer budgets), or None.
    hol: jax.Array | None = None

    tokens = property(lambda self: self.tok[0])  # i32[T]
    positions = property(lambda self: self.tok[1])  # i32[T]
    feed = property(lambda self: self.tok[3])  # i32[T]: previous step's sample slot, or -1

    @property
    def md(self) -> AttentionMetadata:
        s = self.page_indices.shape[0]
        return AttentionMetadata(slot_mapping=self.tok[2], page_indices=self.page_indices,
                                 kv_lens=self.seq[0, :s], cu_q_lens=self.seq[1],
                                 num_seqs=self.seq[0, s:], cascade=self.casc,
                                 group_slots=self.grp, kivi=self.kivi, kv_holes=self.hol)


@dataclasses.dataclass
class StepBatch:
    """A built step: its device batch and what reading its result back needs.

    Sample slots ``0 .. num_decode - 1`` are the decodes (``decode`` in batch order, each sampling
    its token at ``decode_pos``); ``samples`` lists the other sampling items as (sequence, first
    slot, number of slots, position of the sampled token).
    """

    device: DeviceBatch
    num_tokens: int
    num_seqs: int
    decode: list[Sequence]
    decode_pos: np.ndarray  # i64[nd]
    samples: list[tuple[Sequence, int, int, int]]
    items: list  # the scheduler's ScheduledSeq items (prefill chunks, odd decodes)
    item_ends: list[int]  # each item's computed count once the step ran
    # Sequences whose input token is fed from the previous step: their ids, rows (at build time)
    # and that token's position.
    fed: list = dataclasses.field(default_factory=list)
    fed_rows: np.ndarray | None = None
    fed_pos: list[int] = dataclasses.field(default_factory=list)
    decode_rows: np.ndarray | None = None  # the decodes' rows when built
    epoch: int = -1  # the input batch's epoch when built: the rows hold while it is unchanged
    stop_any: np.ndarray | None = None  # decodes that may stop whatever they sample
    # Log-probabilities asked for (the step then returns them): decodes (indices into
    # ``decode``) and sampling items (indices into ``samples``) that want them for their sampled
    # token, and prompt positions scored: (sequence, first slot, first position, count).
    lp_decodes: np.ndarray | None = None
    lp_samples: list[int] = dataclasses.field(default_factory=list)
    prompt_lp: list[tuple[Sequence, int, int, int]] = dataclasses.field(default_factory=list)
    with_logprobs: bool = False
    # Speculative verify rows: (sequence, first slot, drafts k, position of the input token).
    verify: list[tuple[Sequence, int, int, int]] = dataclasses.field(default_factory=list)
    step_id: int = -1


@dataclasses.dataclass
class InFlight:
    """A step dispatched and not read back yet."""

    batch: StepBatch
    tokens: jax.Array  # i32[out_size] on device: its samples
    extras: tuple | None = None  # log-probabilities on device, if the batch asked for them


class PendingStep(NamedTuple):
    """A step between ``Engine.dispatch_step`` and ``Engine.finish_step``."""

    timing: object  # paged.workload.metrics.StepTiming
    ended: list  # request ids that timed out or were aborted: reported first
    sched: object  # paged.step.scheduler.SchedulerOutput
    done: InFlight | None  # the step to read back (dispatched by the previous call)
    launched: InFlight | None  # the step this call dispatched (None: nothing to run)


class _ItemPlan(NamedTuple):
    """The scheduled items of one step, in batch order after the decodes."""

    rows: list  # input-batch row of each item
    q_lens: list  # tokens each item computes
    starts: list  # computed tokens before the step
    samples: list  # (sequence, first sample slot, count, position sampled)
    slot_seq: list  # batch index of each item sample slot
    slot_j: list  # sample index within its sequence of each item sample slot
    scored: list  # (batch index, first offset in its chunk, count, sequence, position)
    verifying: list  # (batch index, sequence, drafts, position of its input token)


class _Layout(NamedTuple):
    """A step's device batch as laid out by ``BatchBuilder._lay_out``, and the per-token and
    per-slot arrays the later steps of ``build`` read."""

    device: DeviceBatch
    all_rows: np.ndarray  # intp[s]: input-batch row of each sequence
    q_lens: np.ndarray | list  # tokens per sequence (with items)
    starts: np.ndarray  # computed tokens per sequence before the step
    t: int  # tokens
    s: int  # sequences
    n_rows: int  # sample slots of the samples (verify and scored slots follow)
    cu: np.ndarray  # i32[s_pad + 1]: cumulative query lengths
    owner: np.ndarray  # sequence of each token
    pos: np.ndarray  # position of each token
    slot_rows: np.ndarray  # input-batch row of each sample slot


class BatchBuilder:
    """Turns the scheduler's choice into a ``StepBatch`` and advances the rows it serves."""

    def __init__(self, batch: InputBatch, block_manager, page_size: int, *,
                 min_tokens: int = MIN_TOKENS, min_seqs: int = 1, debug: bool = False,
                 cascade=None, kv_offsets: bool = False):
        self.ib = batch
        # A KV policy compacts sequences: a token's slot is its position minus the row's
        # ``dropped`` (RoPE still takes the position; attention reads the slots).
        self.kv_offsets = kv_offsets
        # Which queries the attention mass counts (``KVPolicy.mass_window``): None: no mass; 0:
        # every query (each step's batch carries ``mw``); w > 0: a prompt's last w queries
        # (``mw`` only in steps that hold some).
        self.mass_window: int | None = None
        # Layers of a KV policy with per-layer budgets (their holes ride in ``hol``), else 0.
        self.hole_layers = 0
        self.cascade = cascade  # paged.step.cascade_plan.CascadePlanner, or None
        self.bm = block_manager
        # Tables per sequence (KV-cache groups), interleaved in a row; 1 without a manager (a
        # builder used only for ``empty`` batches).
        self.num_groups = 1 if block_manager is None else block_manager.num_groups
        self.page_size = page_size
        self.min_tokens = min_tokens
        self.min_seqs = min_seqs
        self.debug = debug
        self.open_pages = None  # packed pages' OpenPages (plan each step's KiviMeta; by the engine)
        self.verify_slots = 0  # a speculating engine's k + 1 (its Speculator sets it): `buckets`

    def buckets(self, num_tokens: int, num_seqs: int, num_samples: int, verify: bool = False):
        """Padded (tokens, sequences, sample slots) of a step; a ``verify`` step of a speculating
        engine pads its slots to the most its buckets can verify (one shape per bucket pair)."""
        t_pad = next_pow2(max(num_tokens, self.min_tokens))
        s_pad = next_pow2(max(num_seqs, self.min_seqs))
        most = min(t_pad, next_pow2(s_pad * self.verify_slots)) if verify else 1
        return t_pad, s_pad, max(s_pad, next_pow2(num_samples), most)

    def all_shapes(self, max_tokens: int, max_seqs: int) -> list[tuple[int, int, int]]:
        """Every (tokens, sequences, sample slots) bucket of steps within these budgets (sample
        slots = the sequence bucket; parallel sampling may still add a shape)."""
        pow2s = lambda n: [1 << i for i in range(next_pow2(n).bit_length())]  # 1, 2, .., >= n
        return sorted({self.buckets(t, s, s) for t in pow2s(max_tokens)
                       for s in pow2s(min(max_seqs, t))})

    def verify_shapes(self, max_tokens: int, max_seqs: int) -> list[tuple[int, int, int]]:
        """The buckets of steps with verify rows (each samples every one of its tokens)."""
        pow2s = lambda n: [1 << i for i in range(next_pow2(n).bit_length())]
        return sorted({self.buckets(t, s, n, verify=True) for t in pow2s(max_tokens)
                       for s in pow2s(min(max_seqs, t)) for n in pow2s(t)})

    def empty(self, t_pad: int, s_pad: int, n_pad: int, cascade: bool = False) -> DeviceBatch:
        """An all-padding batch of the given shape (compiles the step without touching real KV):
        tokens write the null page, sequences have no keys, samples are greedy. ``cascade``:
        with the planner's shared-prefix metadata, every group padding (the cascade variant a
        decode-only step of this shape takes; needs a planner that is not off)."""
        smp_f = np.zeros((2, n_pad), np.float32)
        smp_f[1] = 1.0  # top_p
        tok = np.zeros((4, t_pad), np.int32)
        tok[2] = NULL_PAGE * self.page_size  # slot mapping
        tok[3] = -1  # nothing fed
        smp = np.zeros((7, n_pad), np.int32)
        smp[5:] = -1  # score the sampled token; nothing to verify
        casc = None
        if cascade:
            if self.cascade is None or self.cascade.mode == "off":
                raise ValueError("cascade=True needs a cascade planner that is not off")
            casc = np.full((self.cascade.num_groups(s_pad), s_pad + 1), -1, np.int32)
            casc[:, 0] = 0  # no prefix tokens, no members: a padding group
        grp = None
        if self.num_groups > 1:
            grp = np.full((self.num_groups - 1, t_pad), NULL_PAGE * self.page_size, np.int32)
        kivi = None
        if self.open_pages is not None:
            from paged.models.kivi_attention import KiviMeta

            kivi = KiviMeta(**self.open_pages.empty(t_pad, s_pad))
        return DeviceBatch(tok=tok,
                           seq=np.zeros((2, s_pad + 1), np.int32),
                           page_indices=np.full((s_pad, self.ib.pages_per_seq), NULL_PAGE, np.int32),
                           smp=smp, smp_f=smp_f, casc=casc, grp=grp, kivi=kivi,
                           mw=np.zeros(t_pad, np.float32) if self.mass_window == 0 else None,
                           hol=np.zeros((self.hole_layers, s_pad, 2), np.int32)
                           if self.hole_layers else None)

    def build(self, decode_rows: np.ndarray, items, copies: bool, *,
              cascade: bool = True) -> StepBatch:
        """The step's batch: the decodes (rows ``decode_rows``, one token each) first, then the
        ``items`` (``ScheduledSeq``). ``copies``: the step copies pages on write (rows refreshed).
        A decode-only step carries shared-prefix groups when the cascade planner takes some
        (``cascade=False``: never, e.g. a draft model's proposals).
        """
        ib = self.ib
        nc_d = self._refresh_tables(decode_rows, copies)
        nd = len(decode_rows)
        decode = [ib.seqs[r] for r in decode_rows.tolist()] if nd != ib.num_rows else list(ib.seqs)
        plan = self._plan_items(items, nd)
        lay = self._lay_out(decode_rows, nc_d, items, plan, cascade)
        fed, fed_rows, fed_pos = self._fill_tokens(lay)
        # (A KV policy's extras; ``device`` shares ``lay.device``'s arrays, filled below.)
        device = lay.device if self.mass_window is None else self._mass_weight(lay)
        if self.hole_layers:  # each compacted row's per-layer holes (its position record's)
            for i, rec in enumerate(ib.seqs[r].kv_pos_key for r in lay.all_rows.tolist()):
                if rec is not None and rec.holes is not None:
                    device.hol[:, i] = rec.holes
        ints = self._fill_sampling(lay, plan.slot_j, nd)
        verify, prompt_lp = self._fill_extra_slots(lay, plan)
        if self.open_pages is not None:  # packed pages: which open pages this step reads/closes
            from paged.models.kivi_attention import KiviMeta

            meta = self.open_pages.plan(device.seq[0], device.seq[1], device.page_indices, lay.s,
                                        device.tok.shape[1])
            device = device.replace(kivi=KiviMeta(**meta))
        if self.debug:
            self._check(lay.all_rows, lay.device.page_indices)
        decode_pos = ib.num_tokens[decode_rows].astype(np.int64)
        # Decodes that may stop whatever they sample (a length limit or stop ids); EOS is checked
        # against the sampled token.
        d_ints = ints[:nd]
        stop_any = np.flatnonzero((decode_pos + 1 >= d_ints[:, LIMIT]) | (d_ints[:, HAS_STOP_IDS] != 0))
        lp_decodes = np.flatnonzero(d_ints[:, LOGPROBS] >= 0)
        samples = plan.samples
        lp_samples = [j for j, x in enumerate(samples) if x[0].params.logprobs is not None]
        return StepBatch(device=device, num_tokens=lay.t, num_seqs=lay.s, decode=decode,
                         lp_decodes=lp_decodes, lp_samples=lp_samples, prompt_lp=prompt_lp,
                         with_logprobs=bool(len(lp_decodes) or lp_samples or prompt_lp),
                         verify=verify,
                         decode_pos=decode_pos, samples=samples, items=list(items),
                         item_ends=[c + n for c, n in zip(lay.starts[nd:].tolist(),
                                                          lay.q_lens[nd:].tolist())]
                         if items else [], fed=fed, fed_rows=fed_rows,
                         fed_pos=fed_pos, stop_any=stop_any, decode_rows=decode_rows,
                         epoch=ib.epoch)

    def _refresh_tables(self, decode_rows: np.ndarray, copies: bool) -> np.ndarray:
        """Refreshes the block-table rows of the decodes that may have changed since they were
        copied (all of them after copies on write; else those a block was added to or a window
        recycled blocks of). Returns the decodes' computed counts."""
        ib, page_size = self.ib, self.page_size
        recycled = self.bm.take_recycled_seqs()  # rows whose tables lost blocks to a window
        if recycled:
            for r, sid in enumerate(ib.ids):
                if sid in recycled:
                    ib.num_blocks[r] = -1  # refreshed below if it runs
        nd = len(decode_rows)
        nc_d = ib.num_computed[decode_rows]
        slots = nc_d - ib.dropped[decode_rows] if self.kv_offsets else nc_d
        stale = np.arange(nd) if copies else np.flatnonzero(
            ib.num_blocks[decode_rows] != (slots // page_size + 1) * self.num_groups)
        for i in stale.tolist():
            r = int(decode_rows[i])
            ib.refresh(r, self.bm.block_table(ib.ids[r]))
        return nc_d

    def _plan_items(self, items, nd: int) -> _ItemPlan:
        """Each item's row, query length and start (its table refreshed), and the slots it adds
        after the decodes' samples: its samples, verify rows or scored prompt rows."""
        ib = self.ib
        plan = _ItemPlan([], [], [], [], [], [], [], [])
        rows_o, q_lens, starts, samples, slot_seq, slot_j, scored, verifying = plan
        for i, item in enumerate(items, start=nd):
            q, n = item.seq, item.num_new_tokens
            r, c = q.row, q.num_computed_tokens
            ib.refresh(r, self.bm.block_table(q.seq_id))
            rows_o.append(r)
            q_lens.append(n)
            starts.append(c)
            if q.prompt_logprobs is not None and c < q.num_prompt_tokens - 1:
                # Row c + j predicts prompt token c + j + 1: score it.
                scored.append((i, 0, min(c + n, q.num_prompt_tokens - 1) - c, q, c))
            if item.num_draft:  # verify: every position samples (its slots come after the rest)
                verifying.append((i, q, item.num_draft, c))
            elif c + n == q.num_tokens:  # reaches its end: sample (n slots for an unforked prompt)
                count = q.params.n if q.sample_index == 0 and q.num_output_tokens == 0 else 1
                samples.append((q, nd + len(slot_seq), count, c + n))
                slot_seq.extend([i] * count)
                slot_j.extend(range(count))
        return plan

    def _lay_out(self, decode_rows: np.ndarray, nc_d: np.ndarray, items, plan: _ItemPlan,
                 cascade: bool) -> _Layout:
        """The step's buckets and an empty batch of them, with its block tables, sequence ranges
        and KV lengths, each token's row and position, and each sample slot's token row and KV
        length filled; a decode-only step's shared-prefix groups when the planner takes some."""
        nd = len(decode_rows)
        s = nd + len(items)
        n_rows = nd + len(plan.slot_seq)
        n_scored = sum(x[2] for x in plan.scored)
        n_verify = sum(x[2] + 1 for x in plan.verifying)
        all_rows = np.concatenate([decode_rows, np.asarray(plan.rows, np.intp)]) \
            if items else decode_rows
        if items:
            q_lens = np.concatenate([np.ones(nd, np.int64), np.asarray(plan.q_lens, np.int64)])
            starts = np.concatenate([nc_d, np.asarray(plan.starts, np.int32)])
            t = int(q_lens.sum())
        else:
            q_lens, starts, t = plan.q_lens, nc_d, nd
        t_pad, s_pad, n_pad = self.buckets(t, s, n_rows + n_verify + n_scored, n_verify > 0)
        device = self.empty(t_pad, s_pad, n_pad)
        seq, pages, smp = device.seq, device.page_indices, device.smp
        np.take(self.ib.table, all_rows, axis=0, out=pages[:s])
        kv_lens, cu = seq[0, :s], seq[1]
        seq[0, s_pad] = s  # num_seqs
        if items:
            np.cumsum(q_lens, out=cu[1:s + 1])
            cu[s + 1:] = t
            owner = np.repeat(np.arange(s), q_lens)
            pos = np.arange(t) - np.take(cu, owner) + np.take(starts, owner)
            np.add(starts, q_lens, out=kv_lens)
            slot_idx = np.concatenate([np.arange(nd), np.asarray(plan.slot_seq, np.intp)])
            smp[0, :n_rows] = np.take(cu, slot_idx + 1) - 1  # each sample reads its row's last token
            smp[4, :n_rows] = np.take(kv_lens, slot_idx)
            slot_rows = np.take(all_rows, slot_idx)
        else:
            cu[:s + 1] = owner = np.arange(s + 1)
            cu[s + 1:] = t
            owner = owner[:s]
            pos = starts
            np.add(starts, 1, out=kv_lens)
            smp[0, :n_rows] = owner
            smp[4, :n_rows] = kv_lens
            slot_rows = all_rows
            if cascade and self.cascade is not None:
                casc = self.cascade.plan(pages[:s], kv_lens, s_pad)
                if casc is not None:
                    device = device.replace(casc=casc)
        if self.kv_offsets:  # attention reads the slots (sample_pos above kept the positions)
            kv_lens -= np.take(self.ib.dropped, all_rows)
        return _Layout(device, all_rows, q_lens, starts, t, s, n_rows, cu, owner, pos, slot_rows)

    def _fill_tokens(self, lay: _Layout) -> tuple[list, np.ndarray | None, list]:
        """Each token's id, position and slot in every KV-cache group; a token the host does not
        know yet is fed from the previous step's sample slot. Returns ``(fed, fed_rows,
        fed_pos)``: the fed tokens' sequence ids, rows and positions."""
        ib, page_size, device = self.ib, self.page_size, lay.device
        tok, pages, owner, pos, t = device.tok, device.page_indices, lay.owner, lay.pos, lay.t
        row_of = np.take(lay.all_rows, owner)
        ids = ib.tokens[row_of, pos]
        tok[0, :t] = ids
        tok[1, :t] = pos
        G = self.num_groups
        slot = pos - np.take(ib.dropped, row_of) if self.kv_offsets else pos
        col, offset = slot // page_size * G, slot % page_size
        tok[2, :t] = pages[owner, col] * page_size + offset
        for g in range(1, G):  # the other KV-cache groups' slots (their tables interleave)
            device.grp[g - 1, :t] = pages[owner, col + g] * page_size + offset
        unknown = np.flatnonzero(ids == UNKNOWN)
        fed, fed_rows, fed_pos = [], None, []
        if len(unknown):  # sampled by the step in flight: fed from its output on device
            fed_rows = row_of[unknown]
            tok[3, unknown] = ib.last_slot[fed_rows]
            tok[0, unknown] = 0
            fr = fed_rows.tolist()
            fed = list(ib.ids) if fr == list(range(ib.num_rows)) else [ib.ids[r] for r in fr]
            fed_pos = pos[unknown].tolist()
        return fed, fed_rows, fed_pos

    def _mass_weight(self, lay: _Layout) -> DeviceBatch:
        """The device batch with each token's weight in the attention mass (``mass_window``)."""
        w = np.ones(lay.t, np.float32)
        if self.mass_window:  # a prompt's last ``mass_window`` queries vote
            prompt = np.take(self.ib.num_prompt, np.take(lay.all_rows, lay.owner))
            w = ((lay.pos >= prompt - self.mass_window) & (lay.pos < prompt)).astype(np.float32)
            if not w.any():
                return lay.device
        mw = np.zeros(lay.device.tok.shape[1], np.float32)
        mw[:lay.t] = w
        return lay.device.replace(mw=mw)

    def _fill_sampling(self, lay: _Layout, slot_j: list, nd: int) -> np.ndarray:
        """Each sample slot's sampling parameters (top_k, seed, sample index; temperature,
        top_p). Returns the slots' rows of the input batch's integer parameters."""
        smp, smp_f, n_rows = lay.device.smp, lay.device.smp_f, lay.n_rows
        ints = np.take(self.ib.ints, lay.slot_rows, axis=0)
        smp[1:4, :n_rows] = ints[:, :3].T  # top_k, seed, sample_index
        if slot_j:
            smp[3, nd:n_rows] += np.asarray(slot_j, np.int32)
        smp_f[:, :n_rows] = np.take(self.ib.floats, lay.slot_rows, axis=0).T  # temperature, top_p
        return ints

    def _fill_extra_slots(self, lay: _Layout, plan: _ItemPlan) -> tuple[list, list]:
        """The slots after the samples: verify rows (every position samples and is checked
        against its draft), then scored prompt rows. Returns ``(verify, prompt_lp)``."""
        ib, smp, smp_f, cu = self.ib, lay.device.smp, lay.device.smp_f, lay.cu
        verify, k = [], lay.n_rows
        for i, q, nd_i, c in plan.verifying:  # slot j reads row j of the chunk, predicts c + 1 + j
            cnt, r = nd_i + 1, q.row
            smp[0, k:k + cnt] = cu[i] + np.arange(cnt)
            smp[1:4, k:k + cnt] = ib.ints[r, :3, None]
            smp[4, k:k + cnt] = c + 1 + np.arange(cnt)
            smp[6, k:k + nd_i] = ib.tokens[r, c + 1:c + 1 + nd_i]
            smp_f[:, k:k + cnt] = ib.floats[r, :, None]
            verify.append((q, k, nd_i, c))
            k += cnt
        prompt_lp = []
        for i, j0, cnt, q, c in plan.scored:  # extra slots after the samples: scored prompt rows
            smp[0, k:k + cnt] = cu[i] + j0 + np.arange(cnt)
            smp[5, k:k + cnt] = ib.tokens[q.row, c + 1:c + 1 + cnt]
            prompt_lp.append((q, k, c + 1, cnt))
            k += cnt
        return verify, prompt_lp

    def commit(self, decode_rows: np.ndarray, batch: StepBatch) -> None:
        """Advances the served rows as if the step had run: computed counts, and one unknown
        token per sampling row (filled when the step's result is read back, ``fill``)."""
        ib = self.ib
        nd = len(decode_rows)
        if nd:
            ib.num_computed[decode_rows] += 1
            pos = batch.decode_pos
            ib.tokens[decode_rows, pos] = UNKNOWN
            ib.num_tokens[decode_rows] = pos + 1
            ib.last_slot[decode_rows] = np.arange(nd)
            ib.hold[decode_rows] = pos + 1 >= ib.ints[decode_rows, LIMIT]  # surely done by length
        for item in batch.items:
            q = item.seq
            q.num_computed_tokens = q.num_computed_tokens + item.num_new_tokens
        for q, _, _, _ in batch.verify:  # its tokens are set when read back
            ib.hold[q.row] = True
        for q, slot, count, p in batch.samples:
            r = q.row
            ib.tokens[r, p] = UNKNOWN
            ib.num_tokens[r] = p + 1
            ib.last_slot[r] = slot
            # Its samples are forked from the result, or it is surely done by length: sit out.
            ib.hold[r] = count > 1 or p + 1 >= ib.ints[r, LIMIT]

    def _check(self, rows: np.ndarray, page_indices: np.ndarray) -> None:
        """Debug: every batched row equals the block manager's table (a stale row would attend to,
        or write into, another sequence's pages)."""
        for i, r in enumerate(rows.tolist()):
            table = self.bm.block_table(self.ib.ids[r])
            got = page_indices[i, :len(table)].tolist()
            if got != table or (page_indices[i, len(table):] != NULL_PAGE).any():
                raise AssertionError(f"stale batch row for sequence {self.ib.ids[r]}: {got} vs {table}")


__all__ = ["MIN_TOKENS", "BatchBuilder", "DeviceBatch", "InFlight", "StepBatch"]
