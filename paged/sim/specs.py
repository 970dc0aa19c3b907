"""The figures the analytic step-time models read: a device's (``DeviceSpec``, the H200's with
their sources, its NVLink) and a model's dimensions (``ModelDims``; Llama-3-8B, Qwen2.5-7B,
Llama-3-70B, Mistral-7B in ``MODELS``), with the bytes and FLOPs per step they imply.
"""

from __future__ import annotations

import dataclasses

from paged.accounting.formulas import QUANT_ITEMSIZE, SCALE_BYTES, SCALE_GRANULARITIES
from paged.util import validate


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """An accelerator's figures for the roofline.

    Attributes:
      name: for reports.
      mem_bandwidth: bytes/s the model uses for every byte moved.
      flop_s: FLOP/s the model uses for every FLOP.
      launch_s: fixed device time per step (kernel launches, synchronisation).
      host_s: host time per step (schedule, build, read back): ``host_s[0] + host_s[1] * seqs``.
      swap_bandwidth: bytes/s between host and device memory (swap-out and swap-in pages).
      source: where each figure comes from.
    """

    name: str
    mem_bandwidth: float
    flop_s: float
    launch_s: float = 0.0
    host_s: tuple[float, float] = (0.0, 0.0)
    swap_bandwidth: float = 50e9
    source: str = ""


# H200 (one chip). Bandwidth: the 3.1 TB/s that a jitted copy reached on the machine itself
# (experiments/results/archive/h200/README.md), not the 4.8 TB/s datasheet peak: a decode step is a
# stream over weights and KV, and the copy is the best stream measured there (our paged decode
# kernel reached 83 % of it). FLOP/s: 989 TFLOP/s dense bf16 (datasheet) at 60 % efficiency, an
# assumption for large GEMMs (not measured here). Host: the measured engine host time per step on
# that machine, 0.197 ms at 64 and 0.550 ms at 256 running sequences (same README), as a line.
H200_COPY_BW = 3.1e12
H200_DATASHEET_BW = 4.8e12
H200_PEAK_FLOPS = 989e12
H200 = DeviceSpec(
    name="H200", mem_bandwidth=H200_COPY_BW, flop_s=0.6 * H200_PEAK_FLOPS, launch_s=30e-6,
    host_s=(0.197e-3 - 64 * (0.550e-3 - 0.197e-3) / 192, (0.550e-3 - 0.197e-3) / 192),
    source="bandwidth: measured copy 3.1 TB/s (datasheet 4.8 TB/s); FLOP/s: 0.6 x 989 TFLOP/s "
           "dense bf16 datasheet (efficiency assumed); launch 30 us assumed; host: line through "
           "the measured engine host time (0.197 ms @ 64 seqs, 0.550 ms @ 256 seqs); swap "
           "50 GB/s host link (PCIe Gen5 x16, assumed)")


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """A Llama-style decoder's dimensions (no weights), for bytes and FLOPs per step.

    Attributes mirror ``paged.models.config.LlamaConfig``; ``bytes_per_param`` and
    ``bytes_per_kv`` are the storage sizes (2 for bfloat16). ``kv_cache_dtype`` /
    ``kv_scale_granularity`` are the engine's (``EngineConfig``; :meth:`with_kv_cache` copies
    them): with a quantized format a KV value costs its own size (1 byte) and every (token, KV
    head) or (page, KV head) adds a float32 scale, in the pool geometry (:meth:`num_blocks`) and in
    every byte the roofline counts (:meth:`kv_read_bytes`, :meth:`kv_bytes_per_block`).
    ``sliding_window``: W when every layer attends through a sliding window of W tokens (Mistral's
    ``sliding_window``), else None; the replica then recycles blocks behind the window and counts
    only in-window KV positions read (``paged.sim.batches.step_shape``). A model with full and
    sliding layers is not modelled.
    """

    name: str
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    bytes_per_param: int = 2
    bytes_per_kv: int = 2
    tie_embeddings: bool = False
    kv_cache_dtype: str = "auto"
    kv_scale_granularity: str = "token"
    sliding_window: int | None = None

    def __post_init__(self):
        validate.one_of("kv_cache_dtype", self.kv_cache_dtype, ("auto", *QUANT_ITEMSIZE))
        validate.one_of("kv_scale_granularity", self.kv_scale_granularity, SCALE_GRANULARITIES)
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"sliding_window={w!r} must be None or an int >= 1")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's window (None: full attention), as ``LlamaConfig.layer_windows``."""
        return (self.sliding_window,) * self.num_layers

    def with_kv_cache(self, config) -> ModelDims:
        """These dims with the KV storage of ``config`` (an ``EngineConfig``): its
        ``kv_cache_dtype`` and ``kv_scale_granularity``."""
        return dataclasses.replace(self, kv_cache_dtype=config.kv_cache_dtype,
                                   kv_scale_granularity=config.kv_scale_granularity)

    @classmethod
    def from_llama_config(cls, cfg, *, name: str = "model", bytes_per_param: int = 2,
                          bytes_per_kv: int = 2) -> ModelDims:
        return cls(name=name, d_model=cfg.d_model, num_layers=cfg.num_layers,
                   num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                   ffn_dim=cfg.ffn_dim, vocab_size=cfg.vocab_size, bytes_per_param=bytes_per_param,
                   bytes_per_kv=bytes_per_kv, tie_embeddings=getattr(cfg, "tie_embeddings", False))

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder block: q, k, v, o projections and the SwiGLU MLP."""
        d, hq, hkv, dh, f = self.d_model, self.num_heads, self.num_kv_heads, self.head_dim, self.ffn_dim
        return d * hq * dh + 2 * d * hkv * dh + hq * dh * d + 3 * d * f

    @property
    def matmul_params(self) -> int:
        """Parameters every token multiplies (decoder blocks; the LM head is per sample)."""
        return self.num_layers * self.layer_params

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights a step reads: blocks, LM head (the embedding rows read are few)."""
        return (self.matmul_params + self.d_model * self.vocab_size) * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """``2 * L * h_kv * d_h * b`` with ``b`` the stored value's size (``bytes_per_kv``, or 1 for
        int8 / fp8), scales excluded (as ``paged.accounting.ModelSpec.bytes_per_token``)."""
        b = QUANT_ITEMSIZE.get(self.kv_cache_dtype, self.bytes_per_kv)
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * b

    @property
    def kv_bytes_per_scale(self) -> int:
        """Bytes of one scale slot over the layers, K and V: ``2 * L * h_kv * 4`` (0 unquantized)."""
        if self.kv_cache_dtype == "auto":
            return 0
        return 2 * self.num_layers * self.num_kv_heads * SCALE_BYTES

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of one pool block: its values and its scales (one per token or one per page)."""
        scales = block_size if self.kv_scale_granularity == "token" else 1
        return block_size * self.kv_bytes_per_token + scales * self.kv_bytes_per_scale

    def kv_read_bytes(self, positions, block_size: int):
        """Bytes of ``positions`` KV positions read or written: values plus scales, per position
        ("token"; exact) or per page amortised over ``block_size`` positions ("page"; exact when
        the positions fill whole pages, else it counts the partly filled pages' scales pro rata).
        Unquantized: ``positions * kv_bytes_per_token``, the integer it always was."""
        if self.kv_cache_dtype == "auto":
            return positions * self.kv_bytes_per_token
        if self.kv_scale_granularity == "token":
            return positions * (self.kv_bytes_per_token + self.kv_bytes_per_scale)
        return positions * self.kv_bytes_per_token + positions * self.kv_bytes_per_scale / block_size

    def to_dict(self) -> dict:
        """Its fields (also what enters a simulated replica's prefix-cache salt); without
        ``sliding_window`` when it is None (the salt of a full-attention model is unchanged)."""
        d = dataclasses.asdict(self)
        if d["sliding_window"] is None:
            del d["sliding_window"]
        return d

    def num_blocks(self, kv_bytes: float, block_size: int) -> int:
        """Pool blocks (null page included) that ``kv_bytes`` of KV memory holds."""
        return int(kv_bytes // self.kv_bytes_per_block(block_size)) + 1

    def model_spec(self):
        from paged.accounting import ModelSpec

        return ModelSpec(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                         head_dim=self.head_dim,
                         dtype="bfloat16" if self.bytes_per_kv == 2 else "float32",
                         kv_cache_dtype=self.kv_cache_dtype,
                         scale_granularity=self.kv_scale_granularity)


LLAMA3_8B = ModelDims("Llama-3-8B", d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                      head_dim=128, ffn_dim=14336, vocab_size=128256)
QWEN25_7B = ModelDims("Qwen2.5-7B", d_model=3584, num_layers=28, num_heads=28, num_kv_heads=4,
                      head_dim=128, ffn_dim=18944, vocab_size=152064)
LLAMA3_70B = ModelDims("Llama-3-70B", d_model=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                       head_dim=128, ffn_dim=28672, vocab_size=128256)
# Mistral-7B v0.1 (its config.json: sliding_window 4096 on every layer, 32k positions).
MISTRAL_7B = ModelDims("Mistral-7B", d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                       head_dim=128, ffn_dim=14336, vocab_size=32000, sliding_window=4096)
MODELS = {m.name: m for m in (LLAMA3_8B, QWEN25_7B, LLAMA3_70B, MISTRAL_7B)}

# H200 NVLink 4: 900 GB/s per GPU over both directions (datasheet), so 450 GB/s each way; the
# latency of one small all-reduce over 8 GPUs is an assumption (NCCL-class, not measured here).
H200_NVLINK_BW = 450e9
ALLREDUCE_LATENCY_S = 10e-6
