"""The engine's transport of the hand-over protocol (``paged.fleet.handover``): the device copy.

The prefill replica gathers the request's pages into new arrays (``Engine.send_pages``: a jitted
gather, not donated), ``jax.device_put`` places them on the decode replica's KV sharding (the same
``PartitionSpec``, so with tensor parallel each KV-head shard goes to the matching shard), and the
decode replica scatters them into its fresh blocks (``Engine.receive_pages``: jitted, its cache
donated). All three are dispatched without waiting; the decode replica's next step takes the
scattered cache as input, so it reads the pages only after they landed: the request starts at
dispatch. A helper thread waits for the moved arrays and stamps the time they were ready; the
protocol frees the prefill replica's blocks at the first step end after that (never waiting).

Why a gather + ``device_put`` + scatter: the pool's pages of one request are scattered over the
source cache, and the destination's free blocks over its own; a gather packs them into one array
per leaf (values and, for quantized pages, their scales: one tree-map moves both), so a hand-over
is one batched transfer of whole pages, and ``device_put`` is the one way to move an array
between devices of one process (no home-made RPC). Pages are padded to a power of two (the null
page fills the rest) so the jitted gather and scatter compile a handful of shapes.
"""

from __future__ import annotations

import concurrent.futures
import time

import jax

from paged import accounting


def _wait(arrays) -> float:
    jax.block_until_ready(arrays)
    return time.perf_counter()


class DeviceTransport:
    """Moves a hand-over's pages between two engines' caches (module docstring).

    Args:
      spec: the model's ``accounting.ModelSpec`` (bytes per token, scales).
    """

    starts_on_dispatch = True

    def __init__(self, spec):
        self.spec = spec
        self._pending: list = []  # (flight, future of the landing time)
        # Waits for moved arrays off the engine's thread, so a transfer's time is measured when
        # it lands, not when the next step end looks (the engine itself never waits on it).
        self._waiter = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="handover")

    def nbytes(self, num_tokens: int, page_size: int) -> int:
        return accounting.kv_bytes(self.spec, num_tokens, page_size=page_size)

    def send(self, flight, src, dst, src_pages, dst_pages, now: float) -> int:
        """Dispatches the copy; returns the bytes of the arrays moved."""
        k, v = jax.device_put(src.send_pages(src_pages), dst.placement.kv)
        dst.receive_pages(dst_pages, k, v)
        self._pending.append((flight, self._waiter.submit(_wait, (k, v))))
        return sum(int(x.nbytes) for x in jax.tree.leaves((k, v)))

    def landed(self) -> list:
        """``(flight, time its arrays were ready)`` of each copy done since the last call."""
        done, keep = [], []
        for flight, fut in self._pending:
            (done if fut.done() else keep).append((flight, fut))
        self._pending = keep
        return [(flight, fut.result()) for flight, fut in done]

    def warmup(self, replicas, prefill, decode) -> int:
        """Compiles every page-count bucket of the gather on each prefill replica and of the
        scatter on each decode replica (null pages only: nothing live is read or written), so no
        hand-over pays for a compilation. Returns the number of buckets."""
        e = replicas[prefill[0]]
        counts = []
        c = 1
        while c < 2 * e.pages_per_seq:  # up to next_pow2(pages_per_seq)
            counts.append(c)
            c *= 2
        for i in prefill:
            for j in decode:
                for c in counts:
                    dst = replicas[j]
                    k, v = jax.device_put(replicas[i].send_pages([0] * c), dst.placement.kv)
                    dst.receive_pages([0] * c, k, v)
        jax.block_until_ready([replicas[j].cache for j in decode])
        return len(counts)


__all__ = ["DeviceTransport"]
