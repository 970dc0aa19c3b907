"""One engine over several processes (``jax.distributed``): process 0 leads, the others follow.

Every process builds the same ``Engine`` (same config, same params) over a global device list,
for example ``EngineConfig(tensor_parallel_size=jax.device_count())`` with
``devices=jax.devices()``: the KV pool and the params are sharded over a mesh that spans the
processes, and each process holds its own devices' shards. Process 0 owns the requests and the
host state (scheduler, block manager, input batch): it alone calls ``add_request``/``step``/
``generate``. Every other process calls ``follow(engine)``, which runs the same device calls in
the same order until process 0 calls ``stop_followers(engine)``.

Each device action of process 0 is first broadcast to the followers with JAX's multihost
utilities (``jax.experimental.multihost_utils.broadcast_one_to_all``, a collective over the global
devices, gloo between CPU processes): a fixed-size header (what to run and the shapes), then the
arrays (the step's ``DeviceBatch``, or the pages to copy and poison). All processes then run the
same jitted call over the global mesh. The step's sampled tokens come out fully replicated, so
process 0 reads them from its own devices; no KV ever crosses to the host.

Not supported across processes (``ValueError`` at construction, `paged.config.support`'s
table): ``preemption_mode="swap"``, speculative decoding, the host tier, KV-cache groups and
prefill/decode replicas; data-parallel replicas inside a multi-process engine are not built
either. ``initialize`` is a thin wrapper of
``jax.distributed.initialize`` that selects gloo collectives on CPU.
"""

from __future__ import annotations

import jax
import numpy as np

from paged.step.batch import DeviceBatch

# Header: command, with_logprobs, with_verify, prev is the last step's tokens, T, S, N,
# number of poisoned pages, number of copies.
_HEADER = 9
STOP, STEP, COPIES = 0, 1, 2


def initialize(coordinator_address: str, num_processes: int, process_id: int, **kwargs) -> None:
    """``jax.distributed.initialize`` with CPU collectives over gloo (needed for CPU devices).

    Call it before anything else touches JAX's backends.
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes=num_processes,
                               process_id=process_id, **kwargs)


def spans_processes(devices) -> bool:
    """Whether ``devices`` include another process's devices."""
    me = jax.process_index()
    return any(d.process_index != me for d in devices)


def role(placement, config, pages_per_seq: int):
    """``(leader, follower)`` of an engine on ``placement``: ``(Leader, None)`` on process 0 of a
    multi-process engine, ``(None, process index)`` on the others, ``(None, None)`` when the
    devices are all this process's. The settings refused across processes are
    `paged.config.support`'s (``Engine`` checks them before it gets here)."""
    if not spans_processes(placement.devices):
        return None, None
    if jax.process_index() == 0:
        return Leader(pages_per_seq), None
    return None, jax.process_index()


def _broadcast(tree, is_source: bool):
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(tree, is_source=is_source)


class Leader:
    """Process 0's side: announces each device action before it runs it."""

    def __init__(self, pages_per_seq: int):
        self.pages_per_seq = pages_per_seq

    def _send(self, header: list[int], payload) -> None:
        _broadcast(np.asarray(header, np.int32), True)
        _broadcast(payload, True)

    def wrap(self, fn, variant: tuple[bool, bool], no_prev):
        """``fn`` (a jitted step) that first broadcasts its batch to the followers."""
        lp, verify = variant

        def step(params, cache, batch: DeviceBatch, prev, *q):
            if q:
                raise ValueError("verify inputs are not supported across processes")
            t, s, n = batch.tok.shape[1], batch.page_indices.shape[0], batch.smp.shape[1]
            self._send([STEP, lp, verify, prev is not no_prev, t, s, n, 0, 0],
                       (batch.tok, batch.seq, batch.page_indices, batch.smp, batch.smp_f))
            return fn(params, cache, batch, prev)

        return step

    def copies(self, sched, freed_pages: list[int]) -> None:
        """Announces ``apply_copies``'s poison and copy-on-write work (swap is refused)."""
        poison = sorted(set(freed_pages))
        copies = list(sched.copies)
        if not poison and not copies:
            return
        src = [a for a, _ in copies]
        dst = [b for _, b in copies]
        self._send([COPIES, 0, 0, 0, 0, 0, 0, len(poison), len(copies)],
                   (np.asarray(poison, np.int32), np.asarray(src, np.int32),
                    np.asarray(dst, np.int32)))

    def stop(self) -> None:
        _broadcast(np.asarray([STOP] + [0] * (_HEADER - 1), np.int32), True)


class _Copies:
    """The part of a ``SchedulerOutput`` that ``apply_copies`` reads, for a follower."""

    swap_out = swap_in = ()

    def __init__(self, copies):
        self.copies = copies


def follow(engine) -> int:
    """Runs ``engine``'s device calls as process 0 announces them, until it stops the followers.

    Returns the number of steps run. Call it on every process except 0, with an engine built
    exactly as process 0 built its own.
    """
    from paged.engine.device_step import apply_copies

    if engine.follower is None:
        raise RuntimeError("follow() is for processes other than 0 of a multi-process engine")
    zeros = np.zeros(_HEADER, np.int32)
    last = engine.no_prev_tokens
    steps = 0
    while True:
        cmd, lp, verify, use_prev, t, s, n, n_poison, n_copies = (
            int(x) for x in _broadcast(zeros, False))
        if cmd == STOP:
            return steps
        if cmd == COPIES:
            poison, src, dst = _broadcast(
                (np.zeros(n_poison, np.int32), np.zeros(n_copies, np.int32),
                 np.zeros(n_copies, np.int32)), False)
            engine.cache = apply_copies(engine.cache, _Copies(list(zip(src.tolist(), dst.tolist()))),
                                        None, None, poison.tolist())
            continue
        if cmd != STEP:
            raise RuntimeError(f"unknown command {cmd} from process 0")
        tok, seq, pages, smp, smp_f = _broadcast(
            (np.zeros((4, t), np.int32), np.zeros((2, s + 1), np.int32),
             np.zeros((s, engine.pages_per_seq), np.int32), np.zeros((7, n), np.int32),
             np.zeros((2, n), np.float32)), False)
        batch = DeviceBatch(tok=tok, seq=seq, page_indices=pages, smp=smp, smp_f=smp_f)
        fn = engine.step_variants[bool(lp), bool(verify)]
        out = fn(engine.params, engine.cache, batch, last if use_prev else engine.no_prev_tokens)
        engine.cache, last = out[0], out[1]
        steps += 1


def stop_followers(engine) -> None:
    """Process 0: ends every follower's ``follow`` loop (call once, when done serving)."""
    if engine.leader is None:
        raise RuntimeError("stop_followers() is for process 0 of a multi-process engine")
    engine.leader.stop()


__all__ = ["Leader", "follow", "initialize", "role", "spans_processes",
           "stop_followers"]
