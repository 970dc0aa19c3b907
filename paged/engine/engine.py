"""Engine: requests in, tokens out.

Owns the params, the KV cache (device), the block manager, the input batch and the scheduler
(host). One ``step()``:

    schedule (host) -> swap-out / poison / swap-in / copy-on-write (device, rare)
    -> build the batch from the input batch's rows (numpy, bucketed shapes) -> dispatch the
    device step (two jitted calls: the model forward with KV writes, the cache donated; the
    sampler on the sample slots' logits)
    -> read back the previous step's tokens: fill them in, stop, fork, free (host).

With ``async_scheduling`` (the default) the step dispatched by one call is read back by the next,
so the host schedules and builds step k+1 while the device runs step k; tokens step k+1 needs from
step k are fed on device. Without it each step is read back before the call returns.

The host never reads KV back to decide anything: it sends indices and receives sampled tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as SequenceT

import jax
import numpy as np

from paged.accounting.kv_stats import kv_stats
from paged.config.engine_config import EngineConfig, engine_config, warn_long_window
from paged.config.support import check_supported
from paged.engine import multihost
from paged.engine.device_step import (
    apply_copies,
    compile_shapes,
    device_cache,
    open_pages,
    step_functions,
)
from paged.engine.generate import generate, load_model
from paged.engine.kv_compact import Compactor
from paged.engine.placement import Placement
from paged.engine.spec_decode import SpecStats, Speculator, load_draft
from paged.kv import cache as kc
from paged.kv.host_store import HostTierStore
from paged.kv.spec import KVSpec
from paged.models.config import LlamaConfig
from paged.request.checks import check_request
from paged.request.outputs import CompletionOutput, RequestOutput
from paged.request.sampling import SamplingParams
from paged.step.batch import PendingStep
from paged.step.host_core import HostCore, HostStep
from paged.step.scheduler import SchedulerOutput
from paged.workload.metrics import StepTiming

log = logging.getLogger(__name__)


__all__ = ["CompletionOutput", "Engine", "PendingStep", "RequestOutput", "StepTiming"]


class Engine:
    """Serves requests from a paged (or contiguous) KV cache with continuous batching.

    The host side (request table, block manager, input batch, scheduler, the host step) is a
    ``paged.step.host_core.HostCore`` (``engine.core``); the engine runs the device call (params,
    KV cache, jitted step) and orders the core's ``begin`` / ``finish`` for the overlap.

    Args:
      config: engine settings.
      model_config, params: a model to serve instead of the bundled ``config.model`` (tests use
        random weights this way). Both or neither.
      devices: the devices to run on (default ``jax.devices()``): the first
        ``tensor_parallel_size`` of them, or D x T of them for ``data_parallel_size = D > 1`` (then
        ``Engine(...)`` returns a ``paged.engine.data_parallel.DataParallelEngine``: D replicas).
      mesh: instead of ``devices``, a device mesh with a ``"model"`` axis to shard over (tensor
        parallel, ``paged.engine.placement``); one block manager serves all shards.

    Raises:
      TypeError: ``config`` is not an ``EngineConfig`` (or ``None``: the defaults).
      ValueError: a pool too small for one ``max_model_len`` request, an ``attention_impl`` that
        cannot run here (``check_attention_impl``), D x T more than the devices, KV heads not
        divisible by T, or inconsistent arguments.
    """

    def __new__(cls, config: EngineConfig | None = None, *args, **kwargs):
        if cls is Engine and isinstance(config, EngineConfig) and config.data_parallel_size > 1:
            # A factory: D replicas behind a router (data_parallel never imports this module).
            from paged.engine.data_parallel import DataParallelEngine

            return DataParallelEngine(config, *args, replica_factory=Engine, **kwargs)
        return super().__new__(cls)

    def __init__(self, config: EngineConfig | None = None, *, model_config: LlamaConfig | None = None,
                 params=None, mesh: jax.sharding.Mesh | None = None, devices=None):
        config = engine_config(config, jax.default_backend())
        if config.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size={config.data_parallel_size}: build it with "
                             f"Engine(config) (a DataParallelEngine), not a subclass")
        if (model_config is None) != (params is None):
            raise ValueError("pass both model_config and params, or neither")
        model_config, params, tokenizer = load_model(config, model_config, params)
        warn_long_window(model_config.layer_windows, config.max_model_len)
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        if model_config.vocab_size < self.tokenizer.vocab_size:
            raise ValueError(f"model vocab_size={model_config.vocab_size} < tokenizer's "
                             f"{self.tokenizer.vocab_size}")
        self.placement = placement = Placement.for_replica(
            model_config.num_kv_heads, config.tensor_parallel_size, mesh=mesh, devices=devices)
        check_supported(config, model_config,
                        processes=multihost.spans_processes(placement.devices))
        self._freed_pages: list[int] = []
        self.kv_spec = spec = KVSpec.build(model_config, config)
        self.core = core = HostCore(
            config, tokenizer=tokenizer, vocab_size=model_config.vocab_size, kv_spec=spec,
            on_free=self._freed_pages.extend if config.debug_checks else None)
        page_size, num_pages, host_blocks = core.page_size, core.num_pages, core.host_blocks
        self._inflight: HostStep | None = None  # the step dispatched and not read back yet
        # A multi-process engine's role (paged.engine.multihost): process 0 leads (``leader``), the
        # others follow (``follower``: this process's index).
        self.leader, self.follower = multihost.role(placement, config, core.pages_per_seq)
        # May be switched between steps; speculation proposes from the last step's tokens.
        self.async_scheduling = config.async_scheduling and config.speculative is None
        self.speculator = None if config.speculative is None else Speculator(
            config.speculative, core.batch, core.block_manager, config.max_num_batched_tokens,
            load_draft(config, model_config, num_pages, page_size, host_blocks, placement),
            core.builder)
        core.reader.speculator = self.speculator
        self.open_pages = open_pages(core, config, self.kv_spec)
        self.cache = device_cache(spec, num_pages, page_size, placement.kv, config.max_num_seqs,
                                  core.kv_runner is not None and core.kv_runner.mass)
        self._host_k, self._host_v = kc.host_buffers(self.cache, host_blocks) if host_blocks \
            else (None, None)
        # The host tier's slots (one store per cache: a draft model's gets the same copies).
        n, draft = spec.host_tier_blocks, self.speculator and self.speculator.draft
        self.host_tier = HostTierStore(self.cache, n, poison=config.debug_checks) if n else None
        self._draft_tier = HostTierStore(draft.cache, n) if n and draft is not None else None
        self.params = placement.put_params(params)
        self._compactor = Compactor.build(core.kv_runner, self.cache, core.pages_per_seq * page_size)
        # (with_logprobs, with_verify) -> the jitted step, as a follower process runs it, and as
        # this process calls it (announced to the followers by a leader); the tokens fed as "the
        # previous step's" when no step is in flight.
        self.step_variants, self._variants, self.trace_count, self.no_prev_tokens = \
            step_functions(model_config, config, placement, self.leader)
        self._step_fn = self._variants[False, False]
        self._traces_at_start = self.trace_count()
        self.last_timing = StepTiming()
        self._pending = False  # between dispatch_step() and finish_step()
        # Off (None) unless a driver records the run (``record_steps``).
        self.step_record: list[dict] | None = None

    # --- the host core's parts, read by studies, tests and kv_stats ---------------------
    block_manager = property(lambda self: self.core.block_manager)
    batch = property(lambda self: self.core.batch)
    scheduler = property(lambda self: self.core.scheduler)
    builder = property(lambda self: self.core.builder)
    page_size = property(lambda self: self.core.page_size)
    pages_per_seq = property(lambda self: self.core.pages_per_seq)
    num_requests_served = property(lambda self: self.core.num_requests_served)
    num_steps = property(lambda self: self.core.num_steps)  # steps dispatched

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
          prompt: text (encoded with BOS), a conversation (``{"role", "content"}`` dicts,
            rendered with the model's chat template: `paged.request.chat`) or token ids (a flat
            list/tuple of Python ints, not ``bool``, or a 1-D numpy integer array, each in
            ``[0, vocab_size)``; nothing is coerced). Prompt plus output never exceed
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
          RuntimeError: on a follower process of a multi-process engine (requests go to
            process 0).
        """
        self.add_checked(self.check_request(request_id, prompt, params, arrival_time=arrival_time,
                                            timeout_s=timeout_s, cache_salt=cache_salt))

    def check_request(self, request_id, prompt, params=None, *, arrival_time=None,
                      timeout_s=None, cache_salt=None) -> tuple:
        """``add_request``'s checks alone (no state changes): the checked request, for
        ``add_checked``."""
        self._refuse_follower("add requests there")
        return check_request(self.core, request_id, prompt, params, arrival_time, timeout_s,
                             cache_salt)

    def add_checked(self, checked: tuple, *, seed: int | None = None) -> None:
        """Adds a request ``check_request`` accepted (cannot fail). ``seed``: the seed of an
        unseeded request (default: derived from the engine's seed and request count)."""
        self.core.add(*checked, seed=seed)

    def abort(self, request_id: str) -> bool:
        """Finishes a request now and releases its blocks (quarantined if a step may read them).
        Returns True if it was unfinished; False (logged) for unknown or finished."""
        if not self.core.abort(request_id, time.perf_counter()):
            log.warning("abort(%r): no unfinished request with this id", request_id)
            return False
        return True

    @property
    def cache_salt(self) -> bytes:
        """The salt of every prefix-cache key (model, weights, dtype); tenants' salts extend it."""
        return self.core.cache_salt

    def unfinished_request_ids(self) -> list[str]:
        """Requests added and not yet reported finished."""
        return self.core.unfinished_request_ids()

    def has_unfinished_requests(self) -> bool:
        """Whether ``step()`` has something to do or report: an unfinished request, an unreported
        abort or timeout, or a step in flight; so ``while engine.has_unfinished_requests():
        engine.step()`` ends with nothing in flight or quarantined and every request reported."""
        return self.core.has_unfinished() or self._inflight is not None

    def _refuse_follower(self, what: str) -> None:
        if self.follower is not None:
            raise RuntimeError(f"process {self.follower} follows process 0: {what}")

    # --- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns the requests that got new tokens or finished (a step
        that only computed a prefill chunk reports nothing for that request: vLLM's contract).

        With ``async_scheduling`` this dispatches the next step and then reads back the one the
        previous call dispatched, so the tokens returned are that step's (a call with nothing new
        to run only reads back). Order: requests that timed out or were aborted since the last
        call (by id), then the others in batch order (decodes in row order, then the other items).
        """
        return self.finish_step(self.dispatch_step())

    def dispatch_step(self) -> PendingStep:
        """The first half of ``step()``: begins the next step (``HostCore.begin``, this engine the
        driver) without waiting for a device result; ``finish_step`` follows before the next
        ``dispatch_step``. A host loop over data-parallel replicas dispatches all before it
        finishes any, so their devices run concurrently."""
        if self._pending:
            raise RuntimeError("dispatch_step() twice without finish_step()")
        self._refuse_follower("call paged.engine.multihost.follow(engine), not step()")
        self._timing = timing = StepTiming()
        self._t = time.perf_counter()
        done = self._inflight
        step = self.core.begin(self._t, self)
        if step.batch is not None:
            self._inflight = step
            timing.prepare = time.perf_counter() - self._t
            timing.num_seqs, timing.num_tokens = step.batch.num_seqs, step.batch.num_tokens
        self._pending = True
        return PendingStep(timing, step.ended, step.sched, done,
                           None if step.batch is None else step)

    # HostCore.begin's driver hooks (paged.step.host_core): the device side of a step.
    def planned(self, step: HostStep) -> None:
        """After scheduling: speculation plans its proposals; the step is recorded (untimed)."""
        if self.speculator is not None:
            self.speculator.plan(step.sched)
        self._timing.schedule = (t1 := time.perf_counter()) - self._t
        self._t = t1
        if self.step_record is not None:  # kept out of the step's timed phases
            self.step_record.append(step.record(self.core.batch))
            self._t = time.perf_counter()

    def compact(self, ops) -> None:  # HostCore.begin's hook: a KV policy's compactions
        self.cache = self._compactor.run(self.cache, ops)

    def prepare(self, sched: SchedulerOutput) -> None:
        """The step has begun: its device copies, then the draft model's proposals."""
        self._prepare_device(sched)
        if self.speculator is not None:
            self.speculator.draft_tokens()  # draft method: after the copies, both caches

    def launch(self, batch) -> tuple:
        """Dispatches the device call (the cache donated); returns ``(tokens, extras)`` on
        device. The tokens of the step in flight, if any, are fed on device."""
        done = self._inflight
        prev = done.out[0] if done is not None else self.no_prev_tokens
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
        return tokens, extras

    def finish_step(self, pending: PendingStep) -> list[RequestOutput]:
        """The second half of ``step()``: waits for the step to read back (the previous one with
        ``async_scheduling``, else the one just dispatched), applies its tokens and returns the
        outputs."""
        if not self._pending:
            raise RuntimeError("finish_step() without dispatch_step()")
        self._pending = False
        timing, ended, sched, done, launched = pending
        core = self.core
        made, touched, decode = ([], {}, []) if done is None else \
            self._read_back(done, launched, timing)
        if launched is None:  # nothing dispatched: the step's copies, after the read-back
            self._inflight = None
            # The step's copies (swap, CoW) belong to it: pages they touch stay held until it ends.
            step_id = core.begin_copies()
            self._prepare_device(sched)
            core.finish_copies(step_id)
            if done is None:
                core.idle_step(sched)
        elif not self.async_scheduling:
            self._inflight = None
            made2, touched2, decode2 = self._read_back(launched, None, timing)
            made, decode = made + made2, decode + decode2
            touched.update(touched2)
        t3 = time.perf_counter()
        outputs = core.outputs(ended, decode, made, touched)
        timing.postprocess += time.perf_counter() - t3
        self.last_timing = timing
        return outputs

    def _read_back(self, done: HostStep, nxt: HostStep | None, timing: StepTiming):
        """Waits for ``done``'s tokens and applies them (``HostCore.read_back``)."""
        t, (tokens, extras) = time.perf_counter(), done.out
        tokens = np.asarray(tokens)  # waits for the device
        now = time.perf_counter()
        timing.device += now - t
        extras = None if extras is None else jax.tree_util.tree_map(np.asarray, extras)
        made, touched = self.core.read_back(done, tokens, now, nxt, extras)
        timing.postprocess += time.perf_counter() - now
        return made, touched, done.batch.decode

    def record_steps(self) -> list[dict]:
        """Starts recording every step (an exact replay, ``experiments.replay``); returns the list
        it fills, per ``dispatch_step`` one ``HostStep.record``: ``ended`` (by id), ``batch``
        (``[request_id, sample_index, num_new_tokens]`` in batch order) and ``preempted``."""
        self.step_record = []
        return self.step_record

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache between runs (vLLM's ``reset_prefix_cache``): every cached
        block goes back to the free list, as on a new engine (``experiments.replay`` starts so).
        Returns False (nothing changed) while a request is unfinished or a step in flight, or
        with a host tier (evicted blocks would spill into it)."""
        return self._inflight is None and self.core.reset_prefix_cache()

    def has_step_in_flight(self) -> bool:
        """Whether a dispatched step's result has not been read back yet."""
        return self._inflight is not None

    def set_device_step(self, fn=None) -> None:
        """Replaces the plain jitted device step, for host-only benchmarks (``None`` restores it):
        ``fn(params, cache, device_batch, prev_tokens) -> (cache, tokens)``, ``tokens`` one i32
        per sample slot; ``paged.engine.device_step.stub_step`` returns zeros at once (the host's
        share of a step). Steps with log-probabilities or verify rows run the real variants."""
        self._step_fn = self._variants[False, False] if fn is None else fn

    def _prepare_device(self, sched: SchedulerOutput) -> None:
        if self.leader is not None:
            self.leader.copies(sched, self._freed_pages)
        draft = None if self.speculator is None else self.speculator.draft
        tier = self.core.block_manager.take_tier_copies()
        if draft is not None:  # the same copies on the draft's cache (no poison: see DraftModel)
            draft.cache = apply_copies(draft.cache, sched, draft.host_k, draft.host_v, [],
                                       self._draft_tier, tier)
        self.cache = apply_copies(self.cache, sched, self._host_k, self._host_v, self._freed_pages,
                                  self.host_tier, tier, self.open_pages)

    # --- outputs ------------------------------------------------------------------------
    def generate(self, prompts: SequenceT[str | SequenceT[int]] | str,
                 params: SamplingParams | SequenceT[SamplingParams] | None = None,
                 *, progress: bool = False) -> list[RequestOutput]:
        """Runs prompts (as ``add_request`` takes them; a str or one conversation alone is one
        prompt) to completion; returns their outputs in prompt order. All or nothing: every
        prompt and params is checked before the first is added (one bad prompt: no change)."""
        self._refuse_follower("add requests there")
        return generate(self, self.core, prompts, params, progress=progress)

    def warmup(self, *, logprobs: bool = True, parallel_sampling: bool = True,
               progress: bool = False, max_shapes: int | None = 128) -> int:
        """Compiles what a request can select (``paged.engine.warmup.run``, which says in one
        line how many shapes, and refuses more than ``max_shapes`` step shapes naming the bucket
        settings that bound them), then the host tier's copies. Returns the compilations (as
        ``num_compilations`` counts them)."""
        from paged.engine import warmup

        return warmup.run(self, logprobs=logprobs, parallel_sampling=parallel_sampling,
                          progress=progress, max_shapes=max_shapes)

    def warm_tier(self) -> None:
        """Compiles the host tier's copies at every padded page count (``warmup``'s last part)."""
        if self.host_tier is not None:
            self.cache = self.host_tier.warm(self.cache)
            if self._draft_tier is not None:
                draft = self.speculator.draft
                draft.cache = self._draft_tier.warm(draft.cache)

    def compile_step(self, variant: tuple[bool, bool], shape: tuple) -> None:
        """Compiles the ``(with_logprobs, with_verify)`` step on an all-padding batch of ``shape``
        (tokens, sequences, sample slots; a 4th element True: cascade); touches no KV."""
        fn = self._variants[variant]
        extra = (None, None) if variant[1] else ()
        self.cache = compile_shapes(lambda *a: fn(*a, *extra)[:2], self.params, self.cache,
                                    self.no_prev_tokens, [shape], self.core.builder.empty)

    # --- introspection ------------------------------------------------------------------
    @property
    def num_compilations(self) -> int:
        """Compilations since this engine was built: step and page-copy shapes traced."""
        return self.trace_count() - self._traces_at_start

    def spec_decode_stats(self) -> dict:
        """Speculation counters (``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``,
        ``draft_acceptance_rate``, ``mean_accepted_length``: accepted drafts per verify row,
        ``mean_emitted_per_verify``); all zero without ``speculative``."""
        return (SpecStats() if self.speculator is None else self.speculator.stats).as_dict()

    def kv_stats(self, *, held_for_transfer=()) -> dict:
        """Pool occupancy, prefix-cache and preemption counters, and the memory ledger (bytes).
        ``held_for_transfer``: sequence ids whose blocks a hand-over still holds (ledger
        category ``transfer``; parked sequences are counted there anyway)."""
        return kv_stats(self, held_for_transfer)

    # --- hand-over between replicas (paged.fleet.handover) ------------------------------------
    def send_pages(self, pages):
        """This replica's ``pages`` gathered into new device arrays (``kv_cache.gather_pages``:
        sharded as the cache, nothing donated)."""
        return kc.gather_pages(self.cache, pages)

    def receive_pages(self, pages, k, v) -> None:
        """Writes pages sent by another replica, already placed on this replica's KV sharding,
        into ``pages`` (``kv_cache.scatter_pages``; the cache is donated and replaced). Pages
        freed since the last step are poisoned first (debug), so the poison the next step would
        apply cannot land on what arrives here."""
        if self._freed_pages:
            self.cache = kc.poison(self.cache, sorted(set(self._freed_pages)))
            self._freed_pages.clear()
        self.cache = kc.scatter_pages(self.cache, pages, k, v)
