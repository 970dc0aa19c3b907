"""One simulated engine replica: the real host code path with the device step replaced.

``SimReplica`` is an engine-like object that owns the real ``BlockManager``, ``InputBatch``,
``Scheduler``, ``BatchBuilder`` and ``StepReader`` exactly as ``paged.engine.Engine`` builds them,
and runs the engine's own request bookkeeping (``Engine``'s request-table methods are borrowed
unchanged: ``_add_checked``, ``_expire``, ``_finish_request``, ``_outputs``, ``_final_output``,
``_request_output``, ``_guard_progress``). What it replaces:

* the device call: no KV cache, no weights. A step's duration comes from a
  ``paged.sim.step_model.StepTimeModel`` given the step's ``StepShape``;
* the sampled tokens: deterministic pseudo-tokens, a hash of (the sequence's sampling seed, its
  sample index, the position), in ``[0, 256)`` (byte ids: never BOS or EOS). A request's tokens
  are the same whenever it is recomputed, and different requests' tokens differ, so prefix keys
  behave as they do with a model;
* the clock: the caller passes simulated time to ``begin`` and ``finish``.

Steps are serial, as ``EngineConfig(async_scheduling=False)``: ``begin(now)`` schedules, builds
and commits a step and returns its duration; ``finish(now + duration)`` reads it back
(``StepReader.read``), which stamps the step's tokens with the finish time. Overlap is not
modelled.

``build_device=True`` builds the real padded ``DeviceBatch`` with ``BatchBuilder.build`` each step
(the serving code path, numpy only); ``False`` builds only what ``commit`` and ``StepReader.read``
use (``light_batch``: same decodes, positions, samples, items and stop candidates), which is
faster for large fleets. The tests check that both give the same schedule.
"""

from __future__ import annotations

import numpy as np

from paged.batch import BatchBuilder, StepBatch
from paged.block_manager import BlockManager
from paged.config import EngineConfig
from paged.engine import Engine
from paged.input_batch import HAS_STOP_IDS, LIMIT, SAMPLE_INDEX, SEED, InputBatch
from paged.models.tokenizer import ByteTokenizer
from paged.readback import StepReader
from paged.request_checks import check_request
from paged.routing import cached_prefix_tokens
from paged.scheduler import Scheduler, SchedulerOutput
from paged.sim.step_model import StepShape, StepTimeModel


def pseudo_tokens(seeds, sample_index, positions, salt: int = 0) -> np.ndarray:
    """Deterministic byte tokens, i64[n]: an integer mix of (seed, sample index, position, salt);
    int64 products wrap, which numpy does the same way everywhere."""
    x = (np.asarray(seeds, np.int64) * 40503 + np.asarray(positions, np.int64) * 2654435761
         + np.asarray(sample_index, np.int64) * 97 + salt)
    x ^= x >> 15
    x *= 0x2C1B3C6D
    x ^= x >> 12
    return x & 255


class _Dims:
    """The model facts the host code reads (vocabulary size; a salt for prefix keys)."""

    def __init__(self, vocab_size: int, salt: str):
        self.vocab_size = vocab_size
        self._salt = salt

    def to_dict(self) -> dict:
        return {"sim": self._salt, "vocab_size": self.vocab_size}


class SimReplica:
    """An engine replica whose device step is a step-time model (module docstring).

    Args:
      config: the engine settings (``async_scheduling`` is ignored: steps are serial).
      step_model: seconds per step from its shape.
      model_config: an object with ``vocab_size`` and ``to_dict()`` (a ``LlamaConfig``); it
        enters the prefix-cache salt as in the engine. Default: the byte vocabulary.
      build_device: build the real padded device batch every step (see the module docstring).
      token_salt: mixed into the pseudo-tokens (a different "model").
      record_schedule: keep, per step, ``(start time, [(request id, tokens)], [preempted ids])``.
      name: for reports.
    """

    # The engine's own request bookkeeping, unchanged.
    _add_checked = Engine._add_checked
    _expire = Engine._expire
    _finish_request = Engine._finish_request
    _outputs = Engine._outputs
    _final_output = Engine._final_output
    _request_output = Engine._request_output
    _guard_progress = Engine._guard_progress
    _new_seq_id = Engine._new_seq_id
    unfinished_request_ids = Engine.unfinished_request_ids
    has_unfinished_requests = Engine.has_unfinished_requests

    def __init__(self, config: EngineConfig, step_model: StepTimeModel, *, model_config=None,
                 build_device: bool = True, token_salt: int = 0, record_schedule: bool = False,
                 name: str = "replica"):
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        if not isinstance(step_model, StepTimeModel):
            raise TypeError(f"step_model must be a StepTimeModel, got {type(step_model).__name__}")
        self.config = config
        self.name = name
        self.step_model = step_model
        self.tokenizer = ByteTokenizer()
        self.model_config = model_config or _Dims(self.tokenizer.vocab_size, "byte")
        if config.kv_layout == "paged":
            page_size, num_pages = config.block_size, config.pool_blocks()
            if (num_pages - 1) * page_size < config.max_model_len:
                raise ValueError(f"num_blocks={num_pages} (block_size={page_size}) cannot hold one "
                                 f"request of max_model_len={config.max_model_len}")
        else:
            slots = config.contiguous_slots()
            if slots < 1:
                raise ValueError(f"the pool ({config.pool_blocks()} blocks of {config.block_size}) "
                                 f"cannot reserve one buffer of max_model_len={config.max_model_len}")
            page_size, num_pages = config.max_model_len, slots + 1
        self.page_size = page_size
        self.num_pages = num_pages
        self.pages_per_seq = -(-config.max_model_len // page_size)
        host_blocks = 0
        if config.preemption_mode == "swap":
            host_blocks = num_pages if config.num_host_blocks is None else config.num_host_blocks
        self.block_manager = BlockManager(
            num_pages, page_size,
            enable_prefix_caching=config.enable_prefix_caching and config.kv_layout == "paged",
            cache_salt=f"{config.model}|{self.model_config.to_dict()}|{config.dtype}",
            quarantine_steps=config.quarantine_steps, num_host_blocks=host_blocks,
            debug=config.debug_checks)
        self.batch = InputBatch(config.max_model_len, self.pages_per_seq, self.tokenizer.eos_id)
        self._builder = BatchBuilder(self.batch, self.block_manager, page_size,
                                     min_tokens=config.min_token_bucket,
                                     min_seqs=config.min_seq_bucket, debug=config.debug_checks)
        self.scheduler = Scheduler(config, self.block_manager, self.batch)
        self._requests: dict = {}
        self._num_deadlines = 0
        self._aborted: set[str] = set()
        self._next_seq_id = 0
        self._num_requests = 0
        self._steps_without_progress = 0
        self.num_steps = 0
        self.build_device = bool(build_device)
        self.token_salt = int(token_salt)
        self.schedule_log: list | None = [] if record_schedule else None
        self.busy_s = 0.0
        self._inflight = None
        self._idle = True  # no unfinished request after the last step (or none yet)
        self._reader = StepReader(self)

    # --- what a router reads -----------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.swapped)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def cached_prefix_tokens(self, token_ids, cache_salt=None, probe=None) -> int:
        return cached_prefix_tokens(self.block_manager, token_ids, cache_salt, probe)

    # --- requests ------------------------------------------------------------------------------
    def add_request(self, request_id, prompt, params, *, arrival_time: float,
                    timeout_s: float | None = None, cache_salt=None) -> None:
        """``Engine.add_request`` (same checks) at simulated ``arrival_time``."""
        self._add_checked(*check_request(self, request_id, prompt, params, arrival_time,
                                        timeout_s, cache_salt))

    def abort(self, request_id: str, now: float) -> bool:
        """``Engine.abort`` at simulated time ``now`` (its output comes with the next step)."""
        seqs = self._requests.get(request_id)
        if not seqs or all(s.finished for s in seqs):
            return False
        self._finish_request(request_id, "abort", now)
        self._aborted.add(request_id)
        return True

    @property
    def in_step(self) -> bool:
        return self._inflight is not None

    # --- the step ------------------------------------------------------------------------------
    def begin(self, now: float):
        """Schedules and commits one step at ``now``.

        Returns:
          ``(duration_s, outputs)``: the step's duration (``None`` when nothing could be scheduled;
          then ``outputs`` holds the requests that ended and nothing is in flight).
        """
        if self._inflight is not None:
            raise RuntimeError(f"{self.name}: a step is in flight; finish it first")
        ended = sorted(self._expire(now) | self._aborted)
        self._aborted = set()
        sched = self.scheduler.schedule(now)
        bm = self.block_manager
        if sched.is_empty:
            step_id = bm.begin_step()
            bm.step_completed(step_id)
            self._guard_progress(sched)
            return None, self._outputs(ended)
        self._steps_without_progress = 0
        shape = self.shape_of(sched)
        if self.schedule_log is not None:
            ib = self.batch
            ran = [(ib.seqs[r].request_id, 1) for r in sched.decode_rows.tolist()]
            ran += [(it.seq.request_id, it.num_new_tokens) for it in sched.scheduled]
            self.schedule_log.append((now, ran, [s.request_id for s in sched.preempted]))
        step_id = bm.begin_step()
        if self.build_device:
            batch = self._builder.build(sched.decode_rows, sched.scheduled, bool(sched.copies))
        else:
            batch = light_batch(self.batch, sched)
        batch.step_id = step_id
        tokens = self._tokens(batch)
        self._builder.commit(sched.decode_rows, batch)
        self.num_steps += 1
        duration = float(self.step_model.time(shape))
        self.busy_s += duration
        self._inflight = (batch, tokens, ended)
        return duration, []

    def finish(self, now: float) -> list:
        """Reads back the step in flight at ``now`` (its end); returns the outputs."""
        batch, tokens, ended = self._inflight
        self._inflight = None
        self.block_manager.step_completed(batch.step_id)
        made, touched = self._reader.read(batch, tokens, now, None)
        self._idle = not self.scheduler.has_unfinished()
        if self.config.debug_checks:
            self.block_manager.check_invariants()
            self.batch.check(self.block_manager)
        return self._outputs(ended, batch.decode, made, touched)

    def shape_of(self, sched: SchedulerOutput) -> StepShape:
        """The scheduled step's shape (call before the step is committed)."""
        return step_shape(self.batch, self._builder, sched, after_idle=self._idle)

    def _tokens(self, batch: StepBatch) -> np.ndarray:
        """The step's "sampled" tokens, one per sample slot (decodes first)."""
        ib = self.batch
        nd = len(batch.decode)
        n = nd + sum(c for _, _, c, _ in batch.samples)
        out = np.zeros(n, np.int64)
        if nd:
            rows = batch.decode_rows
            out[:nd] = pseudo_tokens(ib.ints[rows, SEED], ib.ints[rows, SAMPLE_INDEX],
                                     batch.decode_pos, self.token_salt)
        for q, slot, count, p in batch.samples:
            out[slot:slot + count] = pseudo_tokens(
                np.full(count, q.seed), np.arange(count) + q.sample_index, np.full(count, p),
                self.token_salt)
        return out

    # --- figures -------------------------------------------------------------------------------
    def stats(self) -> dict:
        bm = self.block_manager.stats()
        sched = self.scheduler
        return {"name": self.name, "num_steps": self.num_steps, "busy_s": self.busy_s,
                "num_preemptions": sched.num_preemptions, "num_swap_outs": sched.num_swap_outs,
                "prefix_cache_hit_tokens": bm.get("hit_tokens", 0),
                "peak_used_blocks": bm["peak_used_blocks"], "num_blocks": self.num_pages,
                "block_size": self.page_size}


def step_shape(ib: InputBatch, builder: BatchBuilder, sched: SchedulerOutput, *,
               after_idle: bool = False) -> StepShape:
    """The shape of the step ``sched`` describes, read from the input batch before the step is
    committed (``BatchBuilder.commit`` moves the computed counts on). The engine's steps are
    measured with the same function (``experiments/calibrate.py``)."""
    rows = sched.decode_rows
    nd = len(rows)
    kv = int(ib.num_computed[rows].sum()) + nd if nd else 0
    pairs = kv
    t = dec = samples = nd
    prefill = 0
    for item in sched.scheduled:
        q, n = item.seq, item.num_new_tokens
        c = q.num_computed_tokens
        t += n
        kv += c + n
        pairs += n * c + n * (n + 1) // 2
        if n == 1 and c >= q.num_prompt_tokens:
            dec += 1
        else:
            prefill += n
        if c + n == q.num_tokens:
            samples += q.params.n if q.sample_index == 0 and q.num_output_tokens == 0 else 1
    s = nd + len(sched.scheduled)
    tp, sp, _ = builder.buckets(t, s, samples)
    return StepShape(num_tokens=t, num_seqs=s, num_decode=dec, num_prefill_tokens=prefill,
                     kv_read=kv, attn_pairs=pairs, num_samples=samples, padded_tokens=tp,
                     padded_seqs=sp, swap_blocks=len(sched.swap_in) + len(sched.swap_out),
                     copy_blocks=len(sched.copies), after_idle=int(after_idle))


def light_batch(ib: InputBatch, sched: SchedulerOutput) -> StepBatch:
    """The parts of ``BatchBuilder.build``'s ``StepBatch`` that ``commit`` and ``StepReader.read``
    use, without the padded device arrays (serial steps: no token is fed from a step in flight).
    """
    rows = sched.decode_rows
    nd = len(rows)
    decode = list(ib.seqs) if nd == ib.num_rows else [ib.seqs[r] for r in rows.tolist()]
    samples, ends = [], []
    slot = nd
    t = nd
    for item in sched.scheduled:
        q, n = item.seq, item.num_new_tokens
        c = q.num_computed_tokens
        ends.append(c + n)
        t += n
        if c + n == q.num_tokens:
            count = q.params.n if q.sample_index == 0 and q.num_output_tokens == 0 else 1
            samples.append((q, slot, count, c + n))
            slot += count
    decode_pos = ib.num_tokens[rows].astype(np.int64)
    ints = ib.ints[rows]
    stop_any = np.flatnonzero((decode_pos + 1 >= ints[:, LIMIT]) | (ints[:, HAS_STOP_IDS] != 0))
    return StepBatch(device=None, num_tokens=t, num_seqs=nd + len(sched.scheduled), decode=decode,
                     decode_pos=decode_pos, samples=samples, items=list(sched.scheduled),
                     item_ends=ends, stop_any=stop_any, decode_rows=rows, epoch=ib.epoch)


__all__ = ["SimReplica", "light_batch", "pseudo_tokens", "step_shape"]
