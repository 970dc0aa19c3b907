"""Engine: requests in, tokens out.

Owns the params, the KV cache (device), the block manager, the input batch and the scheduler
(host). One ``step()``:

    schedule (host) -> swap-out / poison / swap-in / copy-on-write (device, rare)
    -> build the batch from the input batch's rows (numpy, bucketed shapes) -> dispatch one
    jitted device call (model forward with KV writes, sampling; the cache donated)
    -> read back the previous step's tokens: fill them in, stop, fork, free (host).

With ``async_scheduling`` (the default) the step dispatched by one call is read back by the next,
so the host schedules and builds step k+1 while the device runs step k; tokens step k+1 needs from
step k are fed on device. Without it each step is read back before the call returns.

The host never reads KV back to decide anything: it sends indices and receives sampled tokens.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence as SequenceT

import jax
import numpy as np

from paged import kv_cache as kc
from paged import multihost
from paged.batch import BatchBuilder, InFlight, PendingStep
from paged.block_manager import BlockManager
from paged.config import EngineConfig, engine_config
from paged.device_step import apply_copies, make_step_fn
from paged.input_batch import InputBatch
from paged.kv_stats import kv_stats
from paged.metrics import StepTiming
from paged.models.config import LlamaConfig
from paged.models.tokenizer import ByteTokenizer
from paged.outputs import CompletionOutput, RequestOutput, check_outputs, collect_outputs, state_of
from paged.placement import Placement
from paged.progress import progress as progress_bar
from paged.readback import StepReader
from paged.request_checks import check_prompts, check_request, derive_seed
from paged.sampling import SamplingParams
from paged.scheduler import Scheduler, SchedulerOutput
from paged.sequence import SeqStatus, Sequence
from paged.spec_decode import Speculator, load_draft

log = logging.getLogger(__name__)


__all__ = ["CompletionOutput", "Engine", "PendingStep", "RequestOutput", "StepTiming"]


class Engine:
    """Serves requests from a paged (or contiguous) KV cache with continuous batching.

    Args:
      config: engine settings.
      model_config, params: a model to serve instead of the bundled ``config.model`` (tests use
        random weights this way). Both or neither.
      devices: the devices to run on (default ``jax.devices()``): the first
        ``tensor_parallel_size`` of them, or D x T of them for ``data_parallel_size = D > 1``
        (then ``Engine(...)`` builds a ``paged.data_parallel.DataParallelEngine``: the same API
        over D replicas).
      mesh: instead of ``devices``, a device mesh with a ``"model"`` axis to shard over (tensor
        parallel, ``paged.placement``); one block manager serves all shards.

    Raises:
      TypeError: ``config`` is not an ``EngineConfig`` (or ``None``: the defaults).
      ValueError: a pool too small for one ``max_model_len`` request, an ``attention_impl`` that
        cannot run on this backend (``paged.config.check_attention_impl``), D x T more than the
        devices, KV heads not divisible by T, or inconsistent arguments.
    """

    def __new__(cls, config: EngineConfig | None = None, *args, **kwargs):
        if cls is Engine and isinstance(config, EngineConfig) and config.data_parallel_size > 1:
            from paged.data_parallel import DataParallelEngine

            return super().__new__(DataParallelEngine)  # Python then runs its __init__
        return super().__new__(cls)

    def __init__(self, config: EngineConfig | None = None, *, model_config: LlamaConfig | None = None,
                 params=None, mesh: jax.sharding.Mesh | None = None, devices=None):
        config = engine_config(config, jax.default_backend())
        if config.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size={config.data_parallel_size}: build it with "
                             f"Engine(config) (a DataParallelEngine), not a subclass")
        if (model_config is None) != (params is None):
            raise ValueError("pass both model_config and params, or neither")
        tokenizer = ByteTokenizer()
        if model_config is None:  # a bundled name or a Hugging Face checkpoint directory
            from paged.models.registry import load_any

            model_config, params, tokenizer = load_any(config.model, dtype=config.dtype,
                                                       max_model_len=config.max_model_len)
        else:  # params given (loaded once by a study): a checkpoint's tokenizer still applies
            from paged.models.hf import is_checkpoint_dir
            from paged.models.hf_tokenizer import load_tokenizer

            if is_checkpoint_dir(config.model):
                tokenizer = load_tokenizer(config.model, model_config.vocab_size)
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        if model_config.vocab_size < self.tokenizer.vocab_size:
            raise ValueError(f"model vocab_size={model_config.vocab_size} < tokenizer's "
                             f"{self.tokenizer.vocab_size}")
        page_size, num_pages = config.pool_geometry()
        self.page_size = page_size
        self.pages_per_seq = -(-config.max_model_len // page_size)
        host_blocks = 0
        if config.preemption_mode == "swap":
            host_blocks = num_pages if config.num_host_blocks is None else config.num_host_blocks
        self._freed_pages: list[int] = []
        self.block_manager = BlockManager(
            num_pages, page_size,
            enable_prefix_caching=config.enable_prefix_caching and config.kv_layout == "paged",
            cache_salt=f"{config.model}|{model_config.to_dict()}|{config.dtype}",
            quarantine_steps=config.quarantine_steps,
            num_host_blocks=host_blocks,
            debug=config.debug_checks,
            on_free=self._freed_pages.extend if config.debug_checks else None,
        )
        self.batch = InputBatch(config.max_model_len, self.pages_per_seq, self.tokenizer.eos_id)
        self._builder = BatchBuilder(self.batch, self.block_manager, page_size,
                                     min_tokens=config.min_token_bucket, min_seqs=config.min_seq_bucket,
                                     debug=config.debug_checks)
        self.scheduler = Scheduler(config, self.block_manager, self.batch)
        self._inflight: InFlight | None = None  # the step dispatched and not read back yet
        self.placement = placement = Placement.for_replica(
            model_config.num_kv_heads, config.tensor_parallel_size, mesh=mesh, devices=devices)
        # A multi-process engine's role (paged.multihost): process 0 leads, the others follow.
        self._leader, self._follower = multihost.role(placement, config, self.pages_per_seq)
        # May be switched between steps; speculation proposes from the last step's tokens.
        self.async_scheduling = config.async_scheduling and config.speculative is None
        self.speculator = None if config.speculative is None else Speculator(
            config.speculative, self.batch, self.block_manager, config.max_num_batched_tokens,
            load_draft(config, model_config, num_pages, page_size, host_blocks, placement),
            self._builder)
        self.cache = kc.KVCache.create(
            model_config.num_layers, model_config.num_kv_heads, num_pages, page_size,
            model_config.head_dim, config.dtype, sharding=placement.kv)
        self._host_k = self._host_v = None
        if host_blocks:
            shape = (model_config.num_layers, model_config.num_kv_heads, host_blocks, page_size,
                     model_config.head_dim)
            self._host_k = np.zeros(shape, np.dtype(self.cache.dtype))
            self._host_v = np.zeros(shape, np.dtype(self.cache.dtype))
        self.params = placement.put_params(params)
        out_size = kc.next_pow2(max(config.max_num_seqs, config.min_seq_bucket))
        # The plain step, and variants that also return log-probabilities and/or verify drafts.
        fns = {v: make_step_fn(model_config, config.attention_impl, out_size, *v)
               for v in itertools.product((False, True), repeat=2)}
        self._variants_raw = {v: f for v, (f, _) in fns.items()}
        self._variants = dict(self._variants_raw)
        self._trace_count = lambda: sum(count() for _, count in fns.values())
        self._no_prev = placement.put(np.zeros(out_size, np.int32))
        if self._leader is not None:  # every device call is announced to the other processes
            self._variants = {v: self._leader.wrap(f, v, self._no_prev)
                              for v, f in self._variants_raw.items()}
        self._step_fn = self._variants[False, False]
        self._traces_at_start = self._trace_count()
        self._requests: dict[str, list[Sequence]] = {}
        self._num_deadlines = 0  # unfinished requests with a timeout (skip the scan when 0)
        self._aborted: set[str] = set()  # aborted since the last step, to report
        self._next_seq_id = 0
        self._num_requests = 0
        self._steps_without_progress = 0
        self.num_steps = 0
        self.num_requests_served = 0  # finished requests reported (any finish reason)
        self.last_timing = StepTiming()
        self._pending = False  # between dispatch_step() and finish_step()
        self._reader = StepReader(self)

    # --- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | SequenceT[int],
                    params: SamplingParams | None = None, *, arrival_time: float | None = None,
                    timeout_s: float | None = None, cache_salt: str | bytes | None = None) -> None:
        """Queues a request. Every argument is checked before any state changes: a request that
        raises leaves the engine exactly as it was (request and sequence counters and the seed
        derivation of later unseeded requests included).

        Args:
          request_id: a non-empty str, unique among unfinished and finished-but-unreported
            requests.
          prompt: text (encoded with BOS) or token ids: a flat list/tuple of Python ints (not
            ``bool``) or a 1-D numpy integer array, each in ``[0, vocab_size)``; nothing is
            coerced (``1.5``, ``"7"``, ``True``, nested lists and 2-D arrays are refused). Prompt
            plus output never exceed ``max_model_len``, so the prompt must be shorter than
            ``max_model_len``: at least one output token must fit.
          params: sampling parameters (default ``SamplingParams()``).
          arrival_time: ``time.perf_counter()`` of arrival (default now), for latency metrics and
            preemption order; a finite real number.
          timeout_s: abort the request this long after arrival (default
            ``config.request_timeout_s``); a finite real number > 0.
          cache_salt: prefix-cache isolation (a non-empty str or bytes; ``None``: no isolation).
            Requests share cached prefix blocks only with requests of the same salt (the salt
            enters every block's key, together with the model's). This matters when one engine
            serves several tenants: a prefix-cache hit makes a prefill measurably faster, so a
            tenant who times its own requests could learn whether another tenant recently sent a
            given prompt. Give each tenant its own salt. Outputs do not depend on the salt; the
            sequence keeps it, so its samples and a re-admission after preemption use it too.

        Raises:
          TypeError: an argument of the wrong type (request id, prompt or token id, params,
            arrival time, timeout, salt).
          ValueError: empty prompt, token id outside the vocabulary, duplicate request id,
            ``params.n > max_num_seqs``, a non-finite arrival time or timeout (or one too large
            for float32), a timeout <= 0, an empty salt, or a prompt of ``max_model_len`` tokens
            or more ("prompt of N tokens leaves no room for output: max_model_len=M").
        """
        self._add_checked(*check_request(self, request_id, prompt, params, arrival_time,
                                        timeout_s, cache_salt))

    def _add_checked(self, request_id, token_ids, params, arrival_time, timeout_s,
                     cache_salt, *, seed: int | None = None) -> None:
        """Adds a request that ``check_request`` accepted (cannot fail). ``seed``: the seed of
        an unseeded request (default: derived from the engine's seed and request count)."""
        now = time.perf_counter() if arrival_time is None else arrival_time
        if params.seed is not None:
            seed = params.seed
        elif seed is None:
            seed = derive_seed(self.config.seed, self._num_requests)
        seq_id = self._new_seq_id()
        if params.prompt_logprobs is not None:  # a prefix-cache hit would skip scored positions
            salt = self.block_manager.cache_salt if cache_salt is None else cache_salt
            cache_salt = salt + f"|prompt-logprobs:{seq_id}".encode()
        seq = Sequence(seq_id, request_id, token_ids, len(token_ids), params, seed, now,
                       deadline=None if timeout_s is None else now + timeout_s,
                       cache_salt=cache_salt)
        self._num_requests += 1
        self._num_deadlines += seq.deadline is not None
        self._requests[request_id] = [seq]
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Finishes a request now and releases its blocks (quarantined if a step may read them).

        Returns:
          True if the request was unfinished; False (with a log message) for unknown or finished.
        """
        seqs = self._requests.get(request_id)
        if not seqs or all(s.finished for s in seqs):
            log.warning("abort(%r): no unfinished request with this id", request_id)
            return False
        self._finish_request(request_id, "abort", time.perf_counter())
        self._aborted.add(request_id)  # its final output comes with the next step
        return True

    @property
    def cache_salt(self) -> bytes:
        """The salt of every prefix-cache key (model, weights, dtype); tenants' salts extend it."""
        return self.block_manager.cache_salt

    def unfinished_request_ids(self) -> list[str]:
        """Requests added and not yet reported finished."""
        return [r for r, seqs in self._requests.items() if r not in self._aborted]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id

    def _finish_request(self, request_id: str, reason: str, now: float) -> None:
        for seq in self._requests[request_id]:
            if not seq.finished:
                self.scheduler.finish(seq, reason, now)

    # --- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns the requests that got tokens or finished.

        With ``async_scheduling`` this dispatches the next step and then reads back the one the
        previous call dispatched, so the tokens returned are that step's (a call with nothing new
        to run only reads back). Order: requests that timed out or were aborted since the last
        call (by id), then the others in batch order (decodes in row order, then the other items).
        """
        return self.finish_step(self.dispatch_step())

    def dispatch_step(self) -> PendingStep:
        """The first half of ``step()``: schedules, builds and dispatches the next device call
        without waiting for any device result. ``finish_step`` must follow before the next
        ``dispatch_step`` (or ``step``) of this engine. A host loop over several engines
        (data-parallel replicas) dispatches all of them before it finishes any, so their devices
        run concurrently."""
        if self._pending:
            raise RuntimeError("dispatch_step() twice without finish_step()")
        if self._follower is not None:
            raise RuntimeError(f"process {self._follower} follows process 0: call "
                               f"paged.multihost.follow(engine), not step()")
        timing = StepTiming()
        t0 = time.perf_counter()
        ended = sorted(self._expire(t0) | self._aborted)  # reported first
        self._aborted = set()
        sched = self.scheduler.schedule(t0)
        if self.speculator is not None:
            self.speculator.plan(sched)
        t1 = time.perf_counter()
        timing.schedule = t1 - t0
        done, launched = self._inflight, None
        if not sched.is_empty:
            self._steps_without_progress = 0
            step_id = self.block_manager.begin_step()
            self._prepare_device(sched)
            if self.speculator is not None:
                self.speculator.draft_tokens()  # draft method: after the copies, both caches
            batch = self._builder.build(sched.decode_rows, sched.scheduled, bool(sched.copies))
            batch.step_id = step_id
            prev = done.tokens if done is not None else self._no_prev
            extras = None
            variant = (batch.with_logprobs, bool(batch.verify))
            if variant == (False, False):
                self.cache, tokens = self._step_fn(self.params, self.cache, batch.device, prev)
            else:
                q = () if not batch.verify else self.speculator.verify_inputs(batch)
                self.cache, tokens, extras = self._variants[variant](
                    self.params, self.cache, batch.device, prev, *q)
            if self.speculator is not None and self.speculator.draft is not None:
                self.speculator.draft.mirror(batch.device)  # the draft's cache follows
            self._builder.commit(sched.decode_rows, batch)
            launched = self._inflight = InFlight(batch, tokens, extras)
            timing.prepare = time.perf_counter() - t1
            timing.num_seqs, timing.num_tokens = batch.num_seqs, batch.num_tokens
            self.num_steps += 1
        self._pending = True
        return PendingStep(timing, ended, sched, done, launched)

    def finish_step(self, pending: PendingStep) -> list[RequestOutput]:
        """The second half of ``step()``: waits for the step to read back (the previous one with
        ``async_scheduling``, else the one just dispatched), applies its tokens and returns the
        outputs."""
        if not self._pending:
            raise RuntimeError("finish_step() without dispatch_step()")
        self._pending = False
        timing, ended, sched, done, launched = pending
        if launched is None:  # nothing dispatched: read back, then the step's copies
            made, touched, decode = self._read_back(done, None, timing) if done else ([], {}, [])
            self._inflight = None
            # The step's copies (swap, CoW) belong to it: pages they touch stay held until it ends.
            step_id = self.block_manager.begin_step()
            self._prepare_device(sched)
            self.block_manager.step_completed(step_id)
            if done is None:
                self._guard_progress(sched)
        else:
            made, touched, decode = [], {}, []
            if done is not None:
                made, touched, decode = self._read_back(done, launched, timing)
            if not self.async_scheduling:
                self._inflight = None
                made2, touched2, decode2 = self._read_back(launched, None, timing)
                made, decode = made + made2, decode + decode2
                touched.update(touched2)
        t3 = time.perf_counter()
        outputs = self._outputs(ended, decode, made, touched)
        timing.postprocess += time.perf_counter() - t3
        self.last_timing = timing
        return outputs

    def _read_back(self, done: InFlight, nxt: InFlight | None, timing: StepTiming):
        """Waits for ``done``'s tokens and applies them (``StepReader``)."""
        t = time.perf_counter()
        tokens = np.asarray(done.tokens)  # waits for the device
        self.block_manager.step_completed(done.batch.step_id)
        now = time.perf_counter()
        timing.device += now - t
        extras = None if done.extras is None else jax.tree_util.tree_map(np.asarray, done.extras)
        made, touched = self._reader.read(done.batch, tokens, now,
                                          None if nxt is None else nxt.batch, extras)
        if self.config.debug_checks:
            self._check_invariants()
        timing.postprocess += time.perf_counter() - now
        return made, touched, done.batch.decode

    def has_step_in_flight(self) -> bool:
        """Whether a dispatched step's result has not been read back yet."""
        return self._inflight is not None

    def _expire(self, now: float) -> set[str]:
        expired = set()
        if not self._num_deadlines:
            return expired
        for request_id, seqs in self._requests.items():
            if any(s.deadline is not None and now >= s.deadline and not s.finished for s in seqs):
                expired.add(request_id)
        for request_id in expired:
            self._finish_request(request_id, "timeout", now)
        return expired

    def _guard_progress(self, sched: SchedulerOutput) -> None:
        if not self.scheduler.has_unfinished():
            return
        self._steps_without_progress += 1
        if self._steps_without_progress > self.config.max_steps_without_progress:
            raise RuntimeError(
                f"no sequence could be scheduled for {self._steps_without_progress} steps "
                f"(waiting={len(self.scheduler.waiting)}, swapped={len(self.scheduler.swapped)}, "
                f"free blocks={self.block_manager.num_allocatable_blocks}); the pool is too small")

    def _prepare_device(self, sched: SchedulerOutput) -> None:
        if self._leader is not None:
            self._leader.copies(sched, self._freed_pages)
        draft = None if self.speculator is None else self.speculator.draft
        if draft is not None:  # the same copies on the draft's cache (no poison: see DraftModel)
            draft.cache = apply_copies(draft.cache, sched, draft.host_k, draft.host_v, [])
        self.cache = apply_copies(self.cache, sched, self._host_k, self._host_v, self._freed_pages)

    def _check_invariants(self) -> None:
        """Debug: the block manager's invariants, and the input batch against it."""
        self.block_manager.check_invariants()
        self.batch.check(self.block_manager)
        if len(self.scheduler.running) != self.batch.num_rows:
            raise AssertionError(f"{len(self.scheduler.running)} running but "
                                 f"{self.batch.num_rows} input-batch rows")

    # --- outputs ------------------------------------------------------------------------
    def _outputs(self, ended: list[str], decode: list[Sequence] = (), made: list = (),
                 touched=()) -> list[RequestOutput]:
        if self.config.debug_checks:  # outputs made on the batched path equal the general ones
            check_outputs(made, self._request_output)
        return collect_outputs(ended, decode, made, touched, self._final_output, self._requests)

    def _final_output(self, request_id: str) -> RequestOutput:
        """The request's output now; a finished request is forgotten (reported once)."""
        out = self._request_output(request_id)
        if out.finished:
            self.num_requests_served += 1
            seqs = self._requests.pop(request_id)
            self._num_deadlines -= seqs[0].deadline is not None
        return out

    def _request_output(self, request_id: str) -> RequestOutput:
        seqs = self._requests[request_id]  # sample order: forks are appended in index order
        head = seqs[0]
        # Samples not forked yet (prompt unfinished) are simply absent.
        finished = all(s.status is SeqStatus.FINISHED for s in seqs) and (
            len(seqs) == head.params.n or head.finish_reason in ("abort", "timeout")
            or head.num_output_tokens == 0)
        finish = max(s.finish_time for s in seqs) if finished else None
        return RequestOutput(head, head.num_known_tokens,
                             state_of(seqs, finished, finish, self.tokenizer.decode))

    def generate(self, prompts: SequenceT[str | SequenceT[int]] | str,
                 params: SamplingParams | SequenceT[SamplingParams] | None = None,
                 *, progress: bool = False) -> list[RequestOutput]:
        """Runs prompts to completion; returns their outputs in prompt order.

        All or nothing: every prompt and params is checked (as ``add_request`` checks them)
        before the first is added, so one bad prompt raises with the engine unchanged.
        """
        checked = check_prompts(self, prompts, params)
        ids = [request[0] for request in checked]
        for request in checked:
            self._add_checked(*request)
        done: dict[str, RequestOutput] = {}
        with progress_bar(len(ids), progress) as update:
            while len(done) < len(ids):
                finished = [out for out in self.step() if out.finished]
                done.update((out.request_id, out) for out in finished)
                update(len(finished))
        return [done[r] for r in ids]

    def warmup(self, *, logprobs: bool = True, parallel_sampling: bool = True,
               progress: bool = False) -> int:
        """Compiles every step a request can select (``paged.warmup``: each step shape, plain and
        with log-probabilities, the sample-slot shapes of ``n > 1``, n-gram verify steps), so no
        request pays for a compilation; ``logprobs=False`` / ``parallel_sampling=False`` skip what
        a workload never asks for. Returns the number of compilations."""
        from paged import warmup

        return warmup.run(self, logprobs=logprobs, parallel_sampling=parallel_sampling,
                          progress=progress)

    # --- introspection ------------------------------------------------------------------
    @property
    def num_compilations(self) -> int:
        """Distinct step shapes traced (each is one XLA compilation)."""
        return self._trace_count() - self._traces_at_start

    def spec_decode_stats(self) -> dict:
        """Speculation counters (``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``,
        ``draft_acceptance_rate``, ``mean_accepted_length``: accepted drafts per verify row,
        ``mean_emitted_per_verify``); all zero without ``speculative``."""
        from paged.spec_decode import SpecStats

        return (SpecStats() if self.speculator is None else self.speculator.stats).as_dict()

    def kv_stats(self) -> dict:
        """Pool occupancy, prefix-cache and preemption counters, and the memory ledger (bytes)."""
        return kv_stats(self)
