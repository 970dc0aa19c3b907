"""What the host KV tier's copies cost in the simulator: the host-device link and the step's bytes.

A simulated replica with ``EngineConfig(host_kv_cache_bytes=N)`` runs the real tier bookkeeping
(``paged.kv.blocks.host_tier``: offload on the device LRU's eviction, host hits at admission, the
``loading`` state); ``TierPricer`` turns each step's ``TierCopies`` into seconds on a ``HostLink``.

How the engine orders the copies, and so how a step is priced (``TierPricer.step_time``):

* **A load is on the step's critical path.** The step's loads are one batched host-to-device copy
  that writes the cache before the step's compute (``kv_cache.swap_in`` on the donated cache,
  threaded before the model call), so the step computes only after it lands:
  ``load_s = latency + wire bytes / h2d_bandwidth`` is added in front of the step's compute. The
  sequences that load are not in that step (they wait in ``loading``); everything else in it waits.
  A step that only loads (nothing else scheduled) is a copy-only step of ``load_s``.
* **An offload runs beside the step, on a copy engine.** The engine dispatches the read of the
  evicted pages before the step and waits for the bytes only before it dispatches the next step
  (``HostTierStore.flush``), so the device-to-host copy overlaps the step's compute:
  the step ends at ``max(load_s + compute_s, offload_s)``; the next step begins after both.
* **Wire bytes.** Both copies move whole blocks (every layer and KV head, scales of a quantized
  cache: ``ModelDims.kv_bytes_per_block``), padded to a power of two as the engine's copies are
  (``kv_cache.pad_pages``: the padding is the null page, or zeros, but it crosses the link).

Link figures (per direction; bandwidths are nominal from the datasheets, the effective figure
and the latency are assumptions, not measured here):

* ``PCIE5_X16``: an H200 (SXM on an HGX board, or H200 NVL) talks to the host CPU over PCIe Gen5
  x16: 32 GT/s x 16 lanes = 64 GB/s per direction nominal (NVIDIA H200 Tensor Core GPU
  datasheet, "PCIe Gen5: 128GB/s", both directions together). Assumed effective: 50 GB/s each way
  (128b/130b line coding leaves 63 GB/s; transaction-layer headers on 256-byte payloads take
  roughly another 10-15 %), from pinned host memory. The engine's slots are pageable numpy memory,
  which the runtime stages through a pinned buffer: likely slower, not measured.
* ``NVLINK_C2C``: a GH200 Grace Hopper Superchip links its GPU to the Grace CPU's LPDDR5X over
  NVLink-C2C, 900 GB/s total, 450 GB/s per direction (NVIDIA GH200 Grace Hopper Superchip
  datasheet, "NVLink-C2C: 900GB/s bidirectional"). Assumed effective: 78 % of nominal, the same
  fraction as PCIe's 50 of 64 (an assumption, not a measured C2C efficiency): 351 GB/s.
* Latency 10 us per batched copy on either link (a copy's launch and completion), assumed.
"""

from __future__ import annotations

import dataclasses
import math

from paged.util import validate


@dataclasses.dataclass(frozen=True)
class HostLink:
    """The host-device link of one GPU, each direction.

    Attributes:
      name: for reports.
      h2d_bandwidth: bytes/s host to device (loads), > 0.
      d2h_bandwidth: bytes/s device to host (offloads), > 0.
      latency_s: seconds added to every batched copy, >= 0.
      nominal_bandwidth: the datasheet's bytes/s per direction (for reports; 0: unknown).
      source: where the figures come from.
    """

    name: str
    h2d_bandwidth: float
    d2h_bandwidth: float
    latency_s: float = 10e-6
    nominal_bandwidth: float = 0.0
    source: str = ""

    def __post_init__(self):
        for key in ("h2d_bandwidth", "d2h_bandwidth"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                    v > 0 and math.isfinite(v)):
                raise ValueError(f"{key}={v!r} must be finite and > 0 (bytes/s)")
        v = self.latency_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                v >= 0 and math.isfinite(v)):
            raise ValueError(f"latency_s={v!r} must be finite and >= 0")

    def load_time(self, nbytes: int) -> float:
        """Seconds to move ``nbytes`` host to device in one copy (0 for no bytes)."""
        return self.latency_s + nbytes / self.h2d_bandwidth if nbytes else 0.0

    def offload_time(self, nbytes: int) -> float:
        """Seconds to move ``nbytes`` device to host in one copy (0 for no bytes)."""
        return self.latency_s + nbytes / self.d2h_bandwidth if nbytes else 0.0


PCIE5_X16 = HostLink(
    "PCIe Gen5 x16 (H200)", 50e9, 50e9, 10e-6, 64e9,
    "NVIDIA H200 Tensor Core GPU datasheet: PCIe Gen5 128 GB/s (64 GB/s per direction); "
    "effective 50 GB/s each way assumed (128b/130b coding, packet headers); latency 10 us assumed")
NVLINK_C2C = HostLink(
    "NVLink-C2C (GH200)", 0.78 * 450e9, 0.78 * 450e9, 10e-6, 450e9,
    "NVIDIA GH200 Grace Hopper Superchip datasheet: NVLink-C2C 900 GB/s bidirectional (450 GB/s "
    "per direction); effective 78 % assumed (PCIe's 50/64); latency 10 us assumed")
HOST_LINKS = {"pcie5": PCIE5_X16, "c2c": NVLINK_C2C}


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else n


@dataclasses.dataclass(frozen=True)
class TierPricer:
    """Seconds of one step's host-tier copies (module docstring).

    Args:
      link: the host-device link.
      bytes_per_block: one block's bytes, every layer and KV head, scales included.
    """

    link: HostLink
    bytes_per_block: int

    def __post_init__(self):
        if not isinstance(self.link, HostLink):
            raise TypeError(f"link must be a HostLink, got {type(self.link).__name__}")
        validate.integer("bytes_per_block", self.bytes_per_block, minimum=1)

    def wire_bytes(self, num_blocks: int) -> int:
        """Bytes one batched copy of ``num_blocks`` blocks moves (padded to a power of two)."""
        return _pow2(num_blocks) * self.bytes_per_block

    def copy_times(self, copies) -> tuple[float, float]:
        """``(load_s, offload_s)`` of a step's ``TierCopies`` (or ``None``: no copies)."""
        if not copies:
            return 0.0, 0.0
        return (self.link.load_time(self.wire_bytes(len(copies.load))),
                self.link.offload_time(self.wire_bytes(len(copies.offload))))

    def step_time(self, compute_s: float, load_s: float, offload_s: float) -> float:
        """A step that carries the copies: the load before the compute, the offload beside."""
        return max(load_s + compute_s, offload_s)

    def describe(self) -> dict:
        return {"link": dataclasses.asdict(self.link), "bytes_per_block": self.bytes_per_block,
                "load": "latency_s + pow2(blocks) * bytes_per_block / h2d_bandwidth, before the "
                        "step's compute",
                "offload": "latency_s + pow2(blocks) * bytes_per_block / d2h_bandwidth, beside "
                           "the step (copy engine)",
                "step": "max(load_s + compute_s, offload_s)"}


__all__ = ["HOST_LINKS", "NVLINK_C2C", "PCIE5_X16", "HostLink", "TierPricer"]
