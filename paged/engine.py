"""Engine: requests in, tokens out.

Owns the params, the KV cache (device), the block manager and the scheduler (host). One
``step()``:

    schedule (host) -> swap-out / poison / swap-in / copy-on-write (device, rare)
    -> build the batch (numpy, bucketed shapes) -> one jitted device call (model forward with KV
    writes, sampling; the cache donated) -> append tokens, stop, free (host).

The host never reads KV back to decide anything: it sends indices and receives sampled tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceT

import jax
import numpy as np

from paged import accounting
from paged import kv_cache as kc
from paged.batch import BatchBuilder, StepBatch
from paged.block_manager import BlockManager
from paged.config import EngineConfig
from paged.decode_run import DecodeRun, sync
from paged.device_step import make_step_fn
from paged.models.config import LlamaConfig
from paged.models.tokenizer import ByteTokenizer
from paged.sampling import SamplingParams
from paged.scheduler import Scheduler, SchedulerOutput
from paged.sequence import SeqStatus, Sequence

log = logging.getLogger(__name__)


class CompletionOutput:
    """One sample of a request, as of the step that produced it.

    Built on every step for every active request, so it is cheap: it keeps a reference to the
    sequence's token list (which only ever grows) and the slice that was current, and decodes
    ``text`` only when asked.
    """

    __slots__ = ("index", "finish_reason", "_ids", "_start", "_end", "_decode", "_text")

    def __init__(self, index: int, ids: list[int], start: int, end: int,
                 finish_reason: str | None, decode: Callable[[list[int]], str]):
        self.index = index
        self.finish_reason = finish_reason  # "stop" | "length" | "abort" | "timeout" | None
        self._ids, self._start, self._end, self._decode, self._text = ids, start, end, decode, None

    @property
    def token_ids(self) -> list[int]:
        return self._ids[self._start:self._end]

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self._decode(self.token_ids)
        return self._text

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, token_ids={self.token_ids}, "
                f"finish_reason={self.finish_reason!r})")


class RequestOutput:
    """A request's state after a step (cumulative tokens), built cheaply on every step.

    ``token_ids`` / ``text`` / ``finish_reason`` are those of sample 0; all samples are in
    ``outputs``. Times are ``time.perf_counter()`` seconds. What can still change later (token
    counts, finish reasons, preemption and cache counters) is recorded when the output is made;
    lists are sliced from the sequences' own append-only lists when read, so an output stays a
    faithful snapshot of its step.

    Three stored fields: the first sequence, its token count, and a tuple of the rest
    (``_state_of``), which an unfinished single-sample request shares between steps
    (``Sequence.out_state``), so making the output of a decode step costs one small object.
    """

    __slots__ = ("_head", "_end", "_state", "_outputs")

    def __init__(self, head: Sequence, end: int, state: tuple):
        """``head``: the request's first sequence; ``end``: its token count now; ``state``:
        ``_state_of``'s tuple."""
        self._head, self._end, self._state = head, end, state

    # Recorded when the output was made (see ``_state_of``).
    request_id = property(lambda self: self._state[0])
    finished = property(lambda self: self._state[1])
    finish_time = property(lambda self: self._state[2])
    num_preemptions = property(lambda self: self._state[3])
    num_cached_tokens = property(lambda self: self._state[4])
    finish_reason = property(lambda self: self._state[5])

    @property
    def outputs(self) -> list[CompletionOutput]:
        """One ``CompletionOutput`` per sample so far (samples not forked yet are absent)."""
        try:
            return self._outputs
        except AttributeError:
            pass
        head, state = sync(self._head), self._state  # its newest tokens may be in a decode run
        samples = ((head, self._end, state[5]), *state[6])
        decode = state[7]
        self._outputs = [CompletionOutput(s.sample_index, s.token_ids, s.num_prompt_tokens, end,
                                          reason, decode) for s, end, reason in samples]
        return self._outputs

    # Set once, before any output of the request exists (or never), so read through.
    arrival_time = property(lambda self: self._head.arrival_time)
    first_scheduled_time = property(lambda self: self._head.first_scheduled_time)
    first_token_time = property(lambda self: self._head.first_token_time)

    @property
    def prompt_token_ids(self) -> list[int]:
        head = self._head
        return head.token_ids[:head.num_prompt_tokens]

    @property
    def token_times(self) -> list[float]:
        """Sample 0: the time each output token arrived on the host."""
        head = sync(self._head)
        return head.token_times[:self._end - head.num_prompt_tokens]

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, finished={self.finished}, "
                f"outputs={self.outputs})")


def _state_of(seqs: list[Sequence], finished: bool, finish_time: float | None,
              decode: Callable[[list[int]], str]) -> tuple:
    """A ``RequestOutput``'s recorded fields: request id, finished, finish time, preemptions
    (all samples), cached prompt tokens, sample 0's finish reason, the other samples'
    (sequence, token count, finish reason), and the tokenizer's decode."""
    head = seqs[0]
    others = tuple((s, len(s.token_ids), s.finish_reason) for s in seqs[1:])
    preemptions = head.num_preemptions if not others else sum(s.num_preemptions for s in seqs)
    return (head.request_id, finished, finish_time, preemptions, head.num_cached_tokens,
            head.finish_reason, others, decode)


def _output_fields(out: RequestOutput) -> tuple:
    return (out.request_id, out.finished, out.finish_time, out.num_preemptions, out.num_cached_tokens,
            out.arrival_time, out.first_scheduled_time, out.first_token_time, out.prompt_token_ids,
            out.token_times, [(o.index, o.token_ids, o.finish_reason) for o in out.outputs])


@dataclasses.dataclass
class StepTiming:
    """Seconds spent in each phase of the last step (host phases vs the device call)."""

    schedule: float = 0.0
    prepare: float = 0.0  # swap / poison / CoW calls + batch build
    device: float = 0.0  # the jitted step, until its tokens are on the host
    postprocess: float = 0.0
    num_seqs: int = 0
    num_tokens: int = 0

    @property
    def host(self) -> float:
        return self.schedule + self.prepare + self.postprocess


class Engine:
    """Serves requests from a paged (or contiguous) KV cache with continuous batching.

    Args:
      config: engine settings.
      model_config, params: a model to serve instead of the bundled ``config.model`` (tests use
        random weights this way). Both or neither.
      mesh: optional device mesh with a ``"model"`` axis: KV pages are sharded on the KV-head axis
        (tensor parallel); one block manager serves all shards.

    Raises:
      ValueError: a pool too small for one ``max_model_len`` request, or inconsistent arguments.
    """

    def __init__(self, config: EngineConfig | None = None, *, model_config: LlamaConfig | None = None,
                 params=None, mesh: jax.sharding.Mesh | None = None):
        config = config or EngineConfig()
        if (model_config is None) != (params is None):
            raise ValueError("pass both model_config and params, or neither")
        if model_config is None:
            from paged.models.registry import load_model

            model_config, params = load_model(config.model)
        self.config = config
        self.model_config = model_config
        self.tokenizer = ByteTokenizer()
        if model_config.vocab_size < self.tokenizer.vocab_size:
            raise ValueError(f"model vocab_size={model_config.vocab_size} < tokenizer's "
                             f"{self.tokenizer.vocab_size}")
        if config.kv_layout == "paged":
            page_size, num_pages = config.block_size, config.pool_blocks()
            if (num_pages - 1) * page_size < config.max_model_len:
                raise ValueError(
                    f"num_blocks={num_pages} (block_size={page_size}) cannot hold one request of "
                    f"max_model_len={config.max_model_len}: need at least "
                    f"{config.max_blocks_per_seq + 1} blocks including the null page")
        else:  # contiguous: one page of max_model_len positions per request slot
            slots = config.contiguous_slots()
            if slots < 1:
                raise ValueError(
                    f"the pool ({config.pool_blocks()} blocks of {config.block_size}) cannot reserve "
                    f"one contiguous buffer of max_model_len={config.max_model_len}")
            page_size, num_pages = config.max_model_len, slots + 1
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
        self._builder = BatchBuilder(self.block_manager, page_size, self.pages_per_seq,
                                     min_tokens=config.min_token_bucket, min_seqs=config.min_seq_bucket,
                                     max_model_len=config.max_model_len,
                                     eos_id=self.tokenizer.eos_id, debug=config.debug_checks)
        self.scheduler = Scheduler(config, self.block_manager, on_release=self._builder.release,
                                   sync=self._end_run)
        self._run: DecodeRun | None = None  # the steady decode batch's token state, if any
        self._offered: list[Sequence] | None = None  # the decode batch offered for the next step
        sharding = None
        if mesh is not None:
            if "model" not in mesh.axis_names:
                raise ValueError(f"mesh axes {mesh.axis_names} must include 'model' (KV heads)")
            if model_config.num_kv_heads % mesh.shape["model"]:
                raise ValueError(f"num_kv_heads={model_config.num_kv_heads} must be divisible by "
                                 f"the mesh's model axis ({mesh.shape['model']})")
            spec = jax.sharding.PartitionSpec(None, "model")
            sharding = jax.sharding.NamedSharding(mesh, spec)
        self.cache = kc.KVCache.create(
            model_config.num_layers, model_config.num_kv_heads, num_pages, page_size,
            model_config.head_dim, config.dtype, sharding=sharding)
        self._host_k = self._host_v = None
        if host_blocks:
            shape = (model_config.num_layers, model_config.num_kv_heads, host_blocks, page_size,
                     model_config.head_dim)
            self._host_k = np.zeros(shape, np.dtype(self.cache.dtype))
            self._host_v = np.zeros(shape, np.dtype(self.cache.dtype))
        replicated = None if mesh is None else jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec())
        self.params = jax.device_put(params, replicated)
        self._step_fn, self._trace_count = make_step_fn(model_config, config.attention_impl)
        self._traces_at_start = self._trace_count()
        self._requests: dict[str, list[Sequence]] = {}
        self._num_deadlines = 0  # unfinished requests with a timeout (skip the scan when 0)
        self._aborted: set[str] = set()  # aborted since the last step, to report
        self._next_seq_id = 0
        self._num_requests = 0
        self._steps_without_progress = 0
        self.num_steps = 0
        self.num_run_steps = 0  # steps whose decodes were recorded in a decode run
        self.last_timing = StepTiming()

    # --- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | SequenceT[int],
                    params: SamplingParams | None = None, *, arrival_time: float | None = None,
                    timeout_s: float | None = None) -> None:
        """Queues a request. Every check runs before any state changes.

        Args:
          request_id: unique among unfinished and finished-but-unreported requests.
          prompt: text (encoded with BOS) or token ids.
          params: sampling parameters (default ``SamplingParams()``).
          arrival_time: ``time.perf_counter()`` of arrival (default now), for latency metrics.
          timeout_s: abort the request this long after arrival (default
            ``config.request_timeout_s``).

        Raises:
          ValueError / TypeError: empty or too long prompt, bad token ids, duplicate id, bad params.
        """
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id={request_id!r} must be a non-empty str")
        if request_id in self._requests:
            raise ValueError(f"duplicate request_id={request_id!r}")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        token_ids = self._encode(prompt)
        if len(token_ids) > self.config.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens > max_model_len="
                             f"{self.config.max_model_len}")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} > max_num_seqs={self.config.max_num_seqs}")
        timeout_s = self.config.request_timeout_s if timeout_s is None else timeout_s
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
        now = time.perf_counter() if arrival_time is None else arrival_time
        seed = params.seed
        if seed is None:
            seed = int(np.random.SeedSequence([self.config.seed, self._num_requests]).generate_state(1)[0]
                       % 2**31)
        seq = Sequence(self._new_seq_id(), request_id, token_ids, len(token_ids), params, seed, now,
                       deadline=None if timeout_s is None else now + timeout_s)
        self._num_requests += 1
        self._num_deadlines += seq.deadline is not None
        self._requests[request_id] = [seq]
        self.scheduler.add(seq)

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, SequenceT | np.ndarray):
            raise TypeError(f"prompt must be str or a sequence of token ids, got {type(prompt).__name__}")
        ids = [int(t) for t in np.asarray(prompt).reshape(-1)] if len(prompt) else []
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} outside [0, {vocab})")
        return ids

    def abort(self, request_id: str) -> bool:
        """Finishes a request now and releases its blocks (quarantined if a step may read them).

        Returns:
          True if the request was unfinished; False (with a log message) for unknown or finished.
        """
        seqs = self._requests.get(request_id)
        if not seqs or all(s.finished for s in seqs):
            log.warning("abort(%r): no unfinished request with this id", request_id)
            return False
        self._end_run()
        self._finish_request(request_id, "abort", time.perf_counter())
        self._aborted.add(request_id)  # its final output comes with the next step
        return True

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
        """Runs one engine step; returns the requests that got tokens or finished in it.

        Order: requests that timed out or were aborted since the last step (by id), then the
        others in batch order (decodes in admission order, then prefills).
        """
        timing = StepTiming()
        t0 = time.perf_counter()
        ended = sorted(self._expire(t0) | self._aborted)  # reported first
        self._aborted = set()
        sched = self.scheduler.schedule(t0)
        run = self._run
        if run is not None and (sched.decode is not run.seqs or sched.scheduled or sched.copies):
            self._end_run()  # anything but the run's next step reads the sequences' lists
        t1 = time.perf_counter()
        timing.schedule = t1 - t0
        # The step's copies (swap, CoW) belong to it: pages they touch stay held until it completes.
        step_id = self.block_manager.begin_step()
        self._prepare_device(sched)
        if sched.is_empty:
            self.block_manager.step_completed(step_id)
            self._guard_progress(sched)
            self.last_timing = timing
            return self._outputs(ended)
        self._steps_without_progress = 0
        batch = self._builder.build(sched.scheduled, sched.decode, sched.decode_tokens,
                                    bool(sched.copies))
        t2 = time.perf_counter()
        timing.prepare = t2 - t1
        self.cache, tokens = self._step_fn(self.params, self.cache, batch.device)
        tokens = np.asarray(tokens)  # waits for the device
        self.block_manager.step_completed(step_id)
        t3 = time.perf_counter()
        timing.device = t3 - t2
        made, touched = self._postprocess(sched, batch, tokens, t3)
        if self.config.debug_checks:
            self._check_invariants()
        self.num_steps += 1
        outputs = self._outputs(ended, sched.decode, made, touched)
        timing.postprocess = time.perf_counter() - t3
        timing.num_seqs, timing.num_tokens = batch.num_seqs, batch.num_tokens
        self.last_timing = timing
        return outputs

    def _expire(self, now: float) -> set[str]:
        expired = set()
        if not self._num_deadlines:
            return expired
        for request_id, seqs in self._requests.items():
            if any(s.deadline is not None and now >= s.deadline and not s.finished for s in seqs):
                expired.add(request_id)
        if expired:
            self._end_run()
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
        """Device-side effects of scheduling, in an order that never loses live KV."""
        if sched.swap_out:  # read before anything can overwrite the freed pages
            pages, slots = map(list, zip(*sched.swap_out))
            k, v = kc.swap_out(self.cache, pages)
            self._host_k[:, :, slots], self._host_v[:, :, slots] = k, v
        if self._freed_pages:  # debug: poison every page whose content was dropped
            self.cache = kc.poison(self.cache, sorted(set(self._freed_pages)))
            self._freed_pages.clear()
        if sched.swap_in:
            slots, pages = map(list, zip(*sched.swap_in))
            self.cache = kc.swap_in(self.cache, pages, self._host_k[:, :, slots], self._host_v[:, :, slots])
        if sched.copies:
            src, dst = map(list, zip(*sched.copies))
            self.cache = kc.copy_pages(self.cache, src, dst)

    def _postprocess(self, sched: SchedulerOutput, batch: StepBatch, tokens: np.ndarray,
                     now: float) -> tuple[list[RequestOutput | None], dict[str, None]]:
        """Records the computed tokens, appends the sampled ones, stops and forks.

        Returns:
          per batched decode, its request's output if already made (else ``None``: made later);
          the other requests that progressed, in batch order.
        """
        bm = self.block_manager
        decode = sched.decode
        made: list[RequestOutput | None] = []
        if decode:  # the batched path: one token computed and one sampled per sequence
            made = self._postprocess_decodes(sched, batch, tokens, now)
        for item in sched.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            bm.mark_computed(seq.seq_id, seq.num_computed_tokens)
        touched: dict[str, None] = {}
        for seq, first_slot, count in batch.samples:
            if seq.finished:
                continue
            touched[seq.request_id] = None
            for j in range(1, count):  # parallel sampling: fork the finished prompt
                child = dataclasses.replace(
                    seq, seq_id=self._new_seq_id(), token_ids=list(seq.token_ids), sample_index=j,
                    token_times=[], status=SeqStatus.WAITING, row=-1, out_state=None, run=None)
                bm.fork(seq.seq_id, child.seq_id)
                self._requests[seq.request_id].append(child)
                self.scheduler.add_running(child)
                self._append_token(child, int(tokens[first_slot + j]), now)
            self._append_token(seq, int(tokens[first_slot]), now)
        return made, touched

    def _postprocess_decodes(self, sched: SchedulerOutput, batch: StepBatch, tokens: np.ndarray,
                             now: float) -> list[RequestOutput | None]:
        """The batched decodes: per sequence, its output if made here (``None``: made later)."""
        decode, run = sched.decode, self._run
        nd = len(decode)
        new = tokens[:nd].tolist()
        made: list[RequestOutput | None]
        if run is not None:  # the run's next step (``step`` ended the run otherwise)
            run.record(tokens[:nd], now)
            self.num_run_steps += 1
            full_ids, full_counts = run.filled()
            made = list(map(RequestOutput, decode, run.lengths(), run.states))
            if self.config.debug_checks:  # every reader then sees current lists
                for seq in decode:
                    run.sync(seq)
        else:
            made = []
            full_ids, full_counts = [], []
            page_size = self.page_size
            text = self.tokenizer.decode
            for seq, t in zip(decode, new):  # one pass: each sequence is touched once
                c = seq.num_computed_tokens + 1
                seq.num_computed_tokens = c
                if not c % page_size:
                    full_ids.append(seq.seq_id)
                    full_counts.append(c)
                seq.token_ids.append(t)
                seq.token_times.append(now)
                # Its output, unless it has several samples (made per request later).
                if seq.params.n > 1:
                    made.append(None)
                    continue
                st = seq.out_state  # shared between steps while these two counters hold
                if st is None or st[3] != seq.num_preemptions or st[4] != seq.num_cached_tokens:
                    st = seq.out_state = _state_of([seq], False, None, text)
                made.append(RequestOutput(seq, c + 1, st))
        # The block manager needs computed counts for one thing: keying blocks that are full and
        # computed. So it hears of a decode when its block fills (its count lags in between,
        # which nothing else reads; the per-item path sends exact counts).
        if full_ids:
            self.block_manager.mark_computed_many(full_ids, full_counts)
        ids = sched.decode_ids
        stopped = False
        for i in self._builder.stop_candidates(batch, new):
            seq = decode[i]
            if run is not None:
                run.sync(seq)
            self._check_stop(seq, new[i], now)
            if seq.finished:
                stopped = True
                made[i] = None  # made again, finished
        if stopped:
            self._end_run()  # the batch changes
        if not sched.scheduled:  # the same decoders (less the finished) go on next step
            steady = decode is self._offered  # this batch repeated the last one
            if stopped:
                keep = [i for i, seq in enumerate(decode) if not seq.finished]
                decode = [decode[i] for i in keep]
                new, ids = [new[i] for i in keep], [ids[i] for i in keep]
            self.scheduler.offer_steady(decode, new, ids)
            self._offered = decode
            # Twice in a row and nothing stopped: likely steady, so keep its tokens in arrays.
            if steady and not stopped and self._run is None and None not in made and decode:
                self._start_run(decode, ids)
        else:
            self._offered = None
        return made

    def _start_run(self, decode: list[Sequence], ids: list) -> None:
        self._run = DecodeRun(decode, ids, self.page_size)

    def _end_run(self) -> None:
        """Brings the decode run's sequences up to date and ends it (see ``paged.decode_run``)."""
        if self._run is not None:
            self._run.end()
            self._run = None

    def _append_token(self, seq: Sequence, token: int, now: float) -> None:
        seq.token_ids.append(token)
        seq.token_times.append(now)
        if seq.first_token_time is None:
            seq.first_token_time = now
        self._check_stop(seq, token, now)

    def _check_stop(self, seq: Sequence, token: int, now: float) -> None:
        """Finishes ``seq`` if its newest token (already appended) ends it."""
        p = seq.params
        reason = None
        if token in p.stop_token_ids or (token == self.tokenizer.eos_id and not p.ignore_eos):
            reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            reason = "length"
        if reason:
            self.scheduler.finish(seq, reason, now)

    def _check_invariants(self) -> None:
        """Debug: the block manager's invariants, and the scheduler's mirror of its slot counts."""
        bm = self.block_manager
        bm.check_invariants()
        for seq in self.scheduler.running:
            if seq.num_slots != bm.num_tokens(seq.seq_id):
                raise AssertionError(f"sequence {seq.seq_id}: num_slots={seq.num_slots} but the "
                                     f"block manager holds {bm.num_tokens(seq.seq_id)}")

    # --- outputs ------------------------------------------------------------------------
    def _outputs(self, ended: list[str], decode: list[Sequence] = (),
                 made: list[RequestOutput | None] = (), touched=()) -> list[RequestOutput]:
        """The step's outputs: ``ended`` requests, then the batched decodes' (``made`` or made
        now), then the ``touched`` ones; each request once. Finished requests are forgotten."""
        outs = [self._final_output(r) for r in ended]
        done = set()  # requests whose output was made here
        if self.config.debug_checks:  # outputs made on the batched path equal the general ones
            for out in made:
                if out is not None:
                    want = self._request_output(out.request_id)
                    assert _output_fields(out) == _output_fields(want), (out, want)
        if None in made:
            for seq, out in zip(decode, made):
                if out is None:
                    if seq.request_id in done:
                        continue
                    done.add(seq.request_id)
                    out = self._final_output(seq.request_id)
                outs.append(out)
        else:
            outs += made
        outs += [self._final_output(r) for r in touched if r not in done]
        return outs

    def _final_output(self, request_id: str) -> RequestOutput:
        """The request's output now; a finished request is forgotten (reported once)."""
        out = self._request_output(request_id)
        if out.finished:
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
        return RequestOutput(head, len(head.token_ids),
                             _state_of(seqs, finished, finish, self.tokenizer.decode))

    def generate(self, prompts: SequenceT[str | SequenceT[int]] | str,
                 params: SamplingParams | SequenceT[SamplingParams] | None = None,
                 *, progress: bool = False) -> list[RequestOutput]:
        """Runs prompts to completion; returns their outputs in prompt order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts")
        base = f"gen{self._num_requests}-"
        ids = [f"{base}{i}" for i in range(len(prompts))]
        added = []
        try:
            for rid, prompt, p in zip(ids, prompts, params_list):
                self.add_request(rid, prompt, p)
                added.append(rid)
        except (ValueError, TypeError):
            for rid in added:  # all or nothing
                self.abort(rid)
                self._requests.pop(rid, None)
                self._aborted.discard(rid)
            raise
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
            if progress:
                print(f"\r{len(done)}/{len(ids)} done", end="", flush=True)
        if progress:
            print()
        return [done[r] for r in ids]

    def warmup(self) -> int:
        """Compiles every step shape this engine can produce (all-padding batches, no KV touched).

        Serving studies call it so no request pays for a compilation. Shapes: token buckets from
        ``min_token_bucket`` to ``max_num_batched_tokens`` times sequence buckets from
        ``min_seq_bucket`` to ``max_num_seqs`` (sample slots = sequence bucket; parallel sampling
        may still add a shape). Returns the number of shapes compiled.
        """
        if self.has_unfinished_requests():
            raise RuntimeError("warmup() must run before requests are added")
        c, b = self.config, self._builder
        pow2s = lambda n: [1 << i for i in range(kc.next_pow2(n).bit_length())]  # 1, 2, .., >= n
        shapes = {b.buckets(t, s, s) for t in pow2s(c.max_num_batched_tokens)
                  for s in pow2s(min(c.max_num_seqs, t))}
        before = self._trace_count()
        for shape in sorted(shapes):
            self.cache, tokens = self._step_fn(self.params, self.cache, b.empty(*shape))
        np.asarray(tokens)
        return self._trace_count() - before

    # --- introspection ------------------------------------------------------------------
    @property
    def num_compilations(self) -> int:
        """Distinct step shapes traced (each is one XLA compilation)."""
        return self._trace_count() - self._traces_at_start

    def kv_stats(self) -> dict:
        """Pool occupancy, prefix-cache and preemption counters, and the memory ledger (bytes)."""
        bm = self.block_manager
        stats = bm.stats()
        spec = accounting.ModelSpec.from_model_config(self.model_config, dtype=self.config.dtype)
        ledger = accounting.MemoryLedger.from_blocks(
            spec, self.page_size, self.cache.num_pages, used=bm.block_usage(),
            cached_free=bm.num_cached_blocks, free=bm.num_free_blocks,
            reserved=bm.num_quarantined_blocks,
            block_table_bytes=accounting.block_table_bytes(self.config.max_num_seqs, self.pages_per_seq),
            workspace_bytes=self._workspace_bytes())
        return {
            "kv_layout": self.config.kv_layout,
            "block_size": self.page_size,
            "num_blocks": self.cache.num_pages,
            "num_free_blocks": bm.num_free_blocks,
            "num_cached_blocks": bm.num_cached_blocks,
            "num_quarantined_blocks": bm.num_quarantined_blocks,
            "num_used_blocks": bm.num_used_blocks,
            "prefix_cache_hit_tokens": stats.get("hit_tokens", 0),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_swap_outs": self.scheduler.num_swap_outs,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_swapped": len(self.scheduler.swapped),
            "block_manager": stats,
            "ledger": ledger.as_dict(),
        }

    def _workspace_bytes(self) -> int:
        """Estimate of the step's largest activations (f32): residual + MLP + logits rows."""
        c, t = self.model_config, self.config.max_num_batched_tokens
        return 4 * t * (3 * c.d_model + 2 * c.ffn_dim + c.num_heads * c.head_dim) + \
            4 * self.config.max_num_seqs * c.vocab_size
