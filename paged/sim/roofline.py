"""The analytic step-time models: a roofline over a device's bandwidth and FLOP/s and a model's
dimensions (``RooflineStepModel``), and its tensor-parallel form over T devices with the
all-reduces (``TensorParallelRooflineStepModel``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from paged.sim.specs import ALLREDUCE_LATENCY_S, H200_NVLINK_BW, DeviceSpec, ModelDims
from paged.sim.step_model import StepShape, StepTimeModel


@dataclasses.dataclass(frozen=True)
class RooflineStepModel(StepTimeModel):
    """``t = host + launch + max(bytes / bandwidth, flops / flop_s)`` per step.

    Bytes: the weights once per step, the KV read (``kv_read - kv_shared`` positions: a
    cascade group's shared prefix is read once; in-window positions only for a sliding-window
    model, as ``step_shape`` counts them) and written (``num_tokens``), copy-on-write pages (read +
    write); swapped pages cross the host link (``swap_bandwidth``) before the step. FLOPs:
    ``2 * matmul_params`` per token, the LM head per sample, attention ``4 * L * Hq * D`` per
    query-key pair (``attn_pairs``; cascade computes the same scores). Activations are not
    counted, nor cascade's second pass and merge (a model: the planner's ``CascadeCost`` prices
    them from CPU timings, not the H200's).
    """

    device: DeviceSpec
    model: ModelDims
    block_size: int = 16
    name = "roofline"
    stateless = True

    def decode_times(self, n, kv0, k, padded_tokens, padded_seqs, after_idle=0):
        # ``time`` of each step as array expressions: the same integers (exact in int64: they
        # stay far below 2**53, so each converts to the same float as Python's int / float)
        # and the same float operations in the same order, hence the same floats.
        w, per_seq, attn, host0, host1, launch, bw, fs, per_pos = self._decode_terms
        j = np.arange(k, dtype=np.int64)
        if per_pos is None:  # quantized: values and scales as ``kv_read_bytes`` counts them
            moved = w + self.model.kv_read_bytes(j * n + (kv0 + n), self.block_size)
        else:  # ``w + (kv + n) * per_pos`` with ``kv = kv0 + j * n``
            moved = j * (n * per_pos) + (w + (kv0 + n) * per_pos)
        flops = j * (attn * n) + (per_seq * n + attn * kv0)
        host = host0 + host1 * n
        return (host + (launch + np.maximum(moved / bw, flops / fs))).tolist()

    @functools.cached_property
    def _decode_terms(self) -> tuple:
        """What ``decode_times`` reads of the model and device: weight bytes; FLOPs per
        sequence (its token's matmuls and LM head) and per KV position; host, launch, bandwidth
        and FLOP rate; KV bytes per position unquantized (else None)."""
        m, d = self.model, self.device
        per_pos = m.kv_bytes_per_token if m.kv_cache_dtype == "auto" else None
        return (m.weight_bytes, 2 * m.matmul_params + 2 * m.d_model * m.vocab_size,
                4 * m.num_layers * m.num_heads * m.head_dim, d.host_s[0], d.host_s[1],
                d.launch_s, d.mem_bandwidth, d.flop_s, per_pos)

    def time(self, s: StepShape) -> float:
        # The model's and device's integer products are taken once (``_time_terms``; integer
        # products regroup exactly), the float operations stay as written, in this order.
        w, block, two_block, mm2, head2, attn, host0, host1, launch, bw, fs, swap_bw, per_pos = \
            self._time_terms
        positions = s.kv_read - s.kv_shared + s.num_tokens
        kv = positions * per_pos if per_pos is not None else \
            self.model.kv_read_bytes(positions, self.block_size)
        moved = w + kv + two_block * s.copy_blocks
        flops = mm2 * s.num_tokens + head2 * s.num_samples + attn * s.attn_pairs
        dev = launch + max(moved / bw, flops / fs)
        if s.swap_blocks:  # over the host link, not overlapped with the step
            dev += block * s.swap_blocks / swap_bw
        return host0 + host1 * s.num_seqs + dev

    @functools.cached_property
    def _time_terms(self) -> tuple:
        """What ``time`` reads of the model and device: weight bytes, bytes per block (and
        twice that), FLOPs per token's matmuls, per sample's LM head and per query-key pair,
        host, launch, bandwidth, FLOP rate, swap bandwidth, KV bytes per position unquantized
        (else None: ``kv_read_bytes``)."""
        m, d = self.model, self.device
        block = m.kv_bytes_per_block(self.block_size)
        per_pos = m.kv_bytes_per_token if m.kv_cache_dtype == "auto" else None
        return (m.weight_bytes, block, 2 * block, 2 * m.matmul_params,
                2 * m.d_model * m.vocab_size, 4 * m.num_layers * m.num_heads * m.head_dim,
                d.host_s[0], d.host_s[1], d.launch_s, d.mem_bandwidth, d.flop_s,
                d.swap_bandwidth, per_pos)

    def describe(self) -> dict:
        return {"name": self.name, "device": dataclasses.asdict(self.device),
                "model": dataclasses.asdict(self.model), "block_size": self.block_size,
                "form": "host0 + host1*seqs + launch + max(bytes/bandwidth, flops/flop_s)"}


@dataclasses.dataclass(frozen=True)
class TensorParallelRooflineStepModel(RooflineStepModel):
    """`RooflineStepModel` of one replica over ``tensor_parallel`` = T devices (Megatron split as
    ``paged.engine.placement``: attention projections, KV heads and MLP sharded T ways; embeddings,
    norms and the LM head replicated), each device the ``device``:

    ``t = host + launch + max(bytes_dev / bandwidth, flops_dev / flop_s) + 2 L allreduce``

    with the decoder blocks' weight bytes and FLOPs, the KV bytes and the attention FLOPs divided
    by T, the LM head's whole on every device, and two all-reduces per layer (after ``o_proj`` and
    after ``down``) of ``num_tokens * d_model`` activations, each ``allreduce_latency_s + 2 (T-1)/T
    * bytes / link_bandwidth`` (ring), not overlapped with compute. T = 1 is `RooflineStepModel`
    plus nothing (no all-reduce).
    """

    tensor_parallel: int = 1
    link_bandwidth: float = H200_NVLINK_BW
    allreduce_latency_s: float = ALLREDUCE_LATENCY_S
    name = "roofline-tp"

    def __post_init__(self):
        t = self.tensor_parallel
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ValueError(f"tensor_parallel={t!r} must be an int >= 1")
        if self.model.num_kv_heads % t or self.model.num_heads % t:
            raise ValueError(f"tensor_parallel={t} does not divide the {self.model.name} heads "
                             f"({self.model.num_heads} query, {self.model.num_kv_heads} KV)")
        for k in ("link_bandwidth", "allreduce_latency_s"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{k}={v!r} must be a finite number >= 0")

    decode_times = StepTimeModel.decode_times  # ``time`` per step (the generic form)

    def time(self, s: StepShape) -> float:
        m, d, t = self.model, self.device, self.tensor_parallel
        block = m.kv_bytes_per_block(self.block_size)
        head = m.d_model * m.vocab_size
        moved = (m.matmul_params * m.bytes_per_param
                 + m.kv_read_bytes(s.kv_read - s.kv_shared + s.num_tokens, self.block_size)
                 + 2 * block * s.copy_blocks) / t + head * m.bytes_per_param
        flops = (2 * m.matmul_params * s.num_tokens
                 + 4 * m.num_layers * m.num_heads * m.head_dim * s.attn_pairs) / t \
            + 2 * head * s.num_samples
        dev = d.launch_s + max(moved / d.mem_bandwidth, flops / d.flop_s)
        if t > 1:
            act = s.num_tokens * m.d_model * m.bytes_per_param
            dev += 2 * m.num_layers * (self.allreduce_latency_s
                                       + 2 * (t - 1) / t * act / self.link_bandwidth)
        if s.swap_blocks:
            dev += block * s.swap_blocks / (t * d.swap_bandwidth)
        return d.host_s[0] + d.host_s[1] * s.num_seqs + dev

    def describe(self) -> dict:
        return {**super().describe(), "name": self.name, "tensor_parallel": self.tensor_parallel,
                "link_bandwidth": self.link_bandwidth,
                "allreduce_latency_s": self.allreduce_latency_s,
                "form": "host0 + host1*seqs + launch + max(bytes_dev/bandwidth, flops_dev/flop_s)"
                        " + 2*L*(allreduce_latency + 2(T-1)/T*tokens*d_model*b/link_bandwidth)",
                "source": "NVLink 450 GB/s per direction (H200 datasheet 900 GB/s both ways); "
                          "all-reduce latency assumed"}
