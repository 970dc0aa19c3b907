"""The simulator's transport of the hand-over protocol (``paged.fleet.handover``): a priced link.

A disaggregated fleet (``Simulator(..., prefill_replicas=P)``, ``paged.sim.disagg``) moves each
prompt's KV from the prefill replica that computed it to a decode replica. ``LinkTransport``
prices one such move: ``bytes = M_KV`` of the prompt tokens the decode replica's prefix cache
lacks, the seed's formula ``2 * L * n * h_kv * d_h * b``
(``paged.accounting.formulas.kv_bytes`` of the model's ``ModelSpec``: with a quantized KV cache ``b`` is the
stored value's size and the scales travel too, per token or per page), and
``time = latency + bytes / bandwidth`` over a ``Link``. Only the prompt's ``n`` valid positions are
counted, as the formula does; a page-granular gather would move up to ``block_size - 1`` positions
of tail padding more per hand-over.

Link figures (one direction, per GPU; the latencies are assumptions, not measured here):

* ``NVLINK4_H200``: NVLink 4 on an H200 (HGX H200 board), 900 GB/s per GPU over both directions,
  so 450 GB/s each way (NVIDIA H200 Tensor Core GPU datasheet, "NVLink: 900GB/s"; the same figure
  ``paged.sim.step_model`` uses for tensor-parallel all-reduces). Latency 10 us, assumed.
* ``IB_NDR_400``: one InfiniBand NDR port per GPU, 400 Gb/s = 50 GB/s each way (NVIDIA ConnectX-7 /
  Quantum-2 NDR datasheets; an HGX H200 node has one 400 Gb/s NIC per GPU). Latency 20 us, assumed
  (RDMA setup and completion included).
* ``IB_HDR_200``: InfiniBand HDR / 200 Gb/s Ethernet, 25 GB/s each way (NVIDIA ConnectX-6
  datasheet). Latency 20 us, assumed.

The per-hand-over latency stands for everything that is not bytes on the wire (a descriptor
exchange, a completion); a real transfer also contends with other traffic, which is modelled only
as one transfer at a time per sending and per receiving GPU (``paged.sim.disagg``).
"""

from __future__ import annotations

import dataclasses
import math

from paged.accounting.formulas import kv_bytes


@dataclasses.dataclass(frozen=True)
class Link:
    """A point-to-point link between two GPUs, one direction.

    Attributes:
      name: for reports.
      bandwidth: bytes/s one way, > 0.
      latency_s: seconds added to every transfer, >= 0.
      source: where the figures come from.
    """

    name: str
    bandwidth: float
    latency_s: float
    source: str = ""

    def __post_init__(self):
        if not (isinstance(self.bandwidth, (int, float)) and self.bandwidth > 0
                and math.isfinite(self.bandwidth)):
            raise ValueError(f"bandwidth={self.bandwidth!r} must be finite and > 0 (bytes/s)")
        if not (isinstance(self.latency_s, (int, float)) and self.latency_s >= 0
                and math.isfinite(self.latency_s)):
            raise ValueError(f"latency_s={self.latency_s!r} must be finite and >= 0")

    def time(self, nbytes: int) -> float:
        """Seconds to move ``nbytes``: ``latency_s + nbytes / bandwidth``."""
        return self.latency_s + nbytes / self.bandwidth


NVLINK4_H200 = Link("NVLink 4 (H200)", 450e9, 10e-6,
                    "NVIDIA H200 datasheet: NVLink 900 GB/s per GPU, both directions (450 GB/s "
                    "each way); latency 10 us assumed")
IB_NDR_400 = Link("InfiniBand NDR 400 Gb/s", 50e9, 20e-6,
                  "NVIDIA ConnectX-7 / Quantum-2: 400 Gb/s per port (50 GB/s each way), one NIC "
                  "per GPU on HGX H200; latency 20 us assumed")
IB_HDR_200 = Link("InfiniBand HDR 200 Gb/s", 25e9, 20e-6,
                  "NVIDIA ConnectX-6: 200 Gb/s per port (25 GB/s each way); latency 20 us assumed")
LINKS = {"nvlink": NVLINK4_H200, "ib_ndr": IB_NDR_400, "ib_hdr": IB_HDR_200}


@dataclasses.dataclass(frozen=True)
class LinkTransport:
    """Prices one prompt's KV hand-over (``starts_on_dispatch`` False: a request starts on the
    decode replica when the copy ends).

    Args:
      link: the link the KV crosses.
      model: a ``paged.sim.specs.ModelDims`` with the KV storage of the engine
        (``ModelDims.with_kv_cache(config)``): its layers, KV heads, head size and bytes per value.
    """

    link: Link
    model: object
    starts_on_dispatch = False

    def __post_init__(self):
        if not isinstance(self.link, Link):
            raise TypeError(f"link must be a Link, got {type(self.link).__name__}")
        if not hasattr(self.model, "model_spec"):
            raise TypeError(f"model must be a ModelDims, got {type(self.model).__name__}")

    def nbytes(self, num_tokens: int, block_size: int) -> int:
        """``M_KV`` of ``num_tokens`` prompt tokens (scales included for a quantized cache; "page"
        scales count ``ceil(num_tokens / block_size)`` pages)."""
        return kv_bytes(self.model.model_spec(), num_tokens, page_size=block_size)

    def time(self, nbytes: int) -> float:
        return self.link.time(nbytes)

    def describe(self) -> dict:
        return {"link": dataclasses.asdict(self.link), "model": self.model.name,
                "bytes": "M_KV = 2 * L * n * h_kv * d_h * b of the prompt (paged.accounting.formulas)",
                "time": "latency_s + bytes / bandwidth; one transfer at a time per GPU each way"}


__all__ = ["IB_HDR_200", "IB_NDR_400", "LINKS", "NVLINK4_H200", "Link", "LinkTransport"]
