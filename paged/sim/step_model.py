"""Step-time models: how long one engine step takes, from the step's shape alone.

The simulator replaces the device call (and the host time around it) with a model
``StepTimeModel.time(shape) -> seconds``. Three families share that interface:

* ``LinearStepModel``: ``t = sum_i coef_i * feature_i(shape)``, fitted by least squares to step
  times measured on a machine (``fit_linear``; ``experiments/calibrate.py`` measures them). The
  default form is ``t = a + b * tokens + c * seqs + d * kv_read``.
* ``RooflineStepModel``: analytic, from a device's memory bandwidth and FLOP/s and a model's
  dimensions (``ModelDims``): ``t = host(seqs) + launch + max(bytes / bandwidth, flops / flop_s)``.
* ``NoisyStepModel``: another model's time times a ratio drawn from a measured distribution (the
  spread a shared machine adds to each step).
* ``ReplayStepModel``: replays a list of recorded step durations in order (tests, what-ifs on a
  recorded run).

A ``StepShape`` is what a step does, counted from the batch the real ``BatchBuilder`` built (or
the simulator's light equivalent): tokens computed, sequences, decodes, prefill tokens, KV
positions read by attention (the sum of the sequences' KV lengths), the padded buckets, and the
pages moved by swap and copy-on-write.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from paged.accounting.formulas import QUANT_ITEMSIZE, SCALE_BYTES, SCALE_GRANULARITIES
from paged.util import validate

FEATURES: dict[str, Callable[[StepShape], float]] = {}


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What one step computes.

    Attributes:
      num_tokens: tokens computed (decodes + prefill chunk tokens), unpadded.
      num_seqs: sequences in the step, unpadded.
      num_decode: sequences computing exactly one token past their prompt (decodes).
      num_prefill_tokens: tokens of prefill chunks (``num_tokens - num_decode``).
      kv_read: KV positions attention reads, summed over sequences (each sequence's KV length
        after the step: computed tokens before it plus the tokens it computes).
      attn_pairs: query x key pairs attention scores, over all sequences (a decode: its KV
        length; a chunk of ``q`` tokens after ``c`` computed ones: ``q * c + q * (q + 1) / 2``,
        causal within the chunk), the term that makes attention FLOPs grow quadratically.
      num_samples: sampled tokens (LM-head rows).
      padded_tokens: the token bucket the device ran (a power of two).
      padded_seqs: the sequence bucket.
      swap_blocks: pages copied between host and device (swap-out + swap-in).
      copy_blocks: pages copied on write.
      after_idle: 1 if the engine was idle (no unfinished request) before this step: on a CPU the
        first step after a pause runs cold (caches, parked threads), which a fit can price.
      kv_shared: of ``kv_read``, the positions cascade attention does not read again: a group of
        ``m`` decodes sharing ``p`` prefix tokens reads them once, not ``m`` times, so
        ``(m - 1) * p`` summed over the step's groups (``paged.step.cascade_plan``; 0 without cascade).
    """

    num_tokens: int
    num_seqs: int
    num_decode: int = 0
    num_prefill_tokens: int = 0
    kv_read: int = 0
    attn_pairs: int = 0
    num_samples: int = 0
    padded_tokens: int = 0
    padded_seqs: int = 0
    swap_blocks: int = 0
    copy_blocks: int = 0
    after_idle: int = 0
    kv_shared: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _feature(name: str):
    def put(fn):
        FEATURES[name] = fn
        return fn
    return put


_feature("const")(lambda s: 1.0)
_feature("tokens")(lambda s: float(s.num_tokens))
_feature("seqs")(lambda s: float(s.num_seqs))
_feature("decode")(lambda s: float(s.num_decode))
_feature("prefill_tokens")(lambda s: float(s.num_prefill_tokens))
# Prefill chunks in the step (sequences that are not decodes): on a CPU a step with a chunk
# costs a fixed amount more than its tokens and sequences say (a wider token bucket, another
# code path), which a fit with only ``tokens`` and ``seqs`` spreads over every step.
_feature("prefill_seqs")(lambda s: float(s.num_seqs - s.num_decode))
_feature("kv_read")(lambda s: float(s.kv_read))
_feature("attn_pairs")(lambda s: float(s.attn_pairs))
_feature("samples")(lambda s: float(s.num_samples))
_feature("padded_tokens")(lambda s: float(s.padded_tokens))
_feature("padded_seqs")(lambda s: float(s.padded_seqs))
_feature("swap_blocks")(lambda s: float(s.swap_blocks))
_feature("copy_blocks")(lambda s: float(s.copy_blocks))
_feature("after_idle")(lambda s: float(s.after_idle))

DEFAULT_FEATURES = ("const", "tokens", "seqs", "kv_read")


class StepTimeModel:
    """Seconds one engine step takes (host and device), from its shape."""

    name = "abstract"
    # True when ``time`` is a pure function of the shape (no draws, no replay position): the
    # simulator may then compute a stretch's step times before it knows whether all of them run.
    stateless = False

    def time(self, shape: StepShape) -> float:
        raise NotImplementedError

    def decode_times(self, n: int, kv0: int, k: int, padded_tokens: int, padded_seqs: int,
                     after_idle: int = 0) -> list[float]:
        """The times of ``k`` consecutive pure decode steps of ``n`` sequences, the first reading
        ``kv0`` KV positions (each later one ``n`` more); only the first may follow a pause.
        Equal to ``time`` of each step's ``StepShape`` (a subclass may compute it faster)."""
        out = []
        for j in range(k):
            kv = kv0 + j * n
            out.append(float(self.time(StepShape(
                num_tokens=n, num_seqs=n, num_decode=n, num_prefill_tokens=0, kv_read=kv,
                attn_pairs=kv, num_samples=n, padded_tokens=padded_tokens,
                padded_seqs=padded_seqs, after_idle=after_idle if j == 0 else 0))))
        return out

    def describe(self) -> dict:
        return {"name": self.name}


# --- linear (fitted) -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LinearStepModel(StepTimeModel):
    """``t = sum(coef[f] * FEATURES[f](shape))``, never below ``floor_s``.

    Attributes:
      coef: feature name -> coefficient (seconds per unit).
      floor_s: smallest step time returned (a fit with a negative coefficient cannot produce a
        step that takes no time).
      fit: how it was fitted (residuals, grid size), for reports.
    """

    coef: Mapping[str, float]
    floor_s: float = 1e-6
    fit: Mapping | None = None
    name = "linear"
    stateless = True  # the same shape always takes the same time (fast-forward may plan ahead)

    def __post_init__(self):
        unknown = sorted(set(self.coef) - set(FEATURES))
        if unknown:
            raise ValueError(f"unknown features {unknown}; known: {sorted(FEATURES)}")
        for k, v in self.coef.items():
            if not math.isfinite(v):
                raise ValueError(f"coef[{k!r}]={v!r} must be finite")
        object.__setattr__(self, "_items", tuple((FEATURES[k], float(v)) for k, v in self.coef.items()))

    def time(self, shape: StepShape) -> float:
        t = 0.0
        for f, c in self._items:
            t += c * f(shape)
        return max(self.floor_s, t)

    def describe(self) -> dict:
        return {"name": self.name, "form": " + ".join(f"{k}*{'1' if k == 'const' else k}"
                                                       for k in self.coef),
                "coef": dict(self.coef), "floor_s": self.floor_s, "fit": self.fit}

    def to_json(self) -> dict:
        return {"family": "linear", "coef": dict(self.coef), "floor_s": self.floor_s,
                "fit": self.fit}

    @classmethod
    def from_json(cls, d: Mapping) -> LinearStepModel:
        if d.get("family") != "linear":
            raise ValueError(f"not a linear step-time model: family={d.get('family')!r}")
        return cls(coef=dict(d["coef"]), floor_s=float(d.get("floor_s", 1e-6)), fit=d.get("fit"))


def fit_linear(shapes: Sequence[StepShape], times_s: Sequence[float],
               features: Sequence[str] = DEFAULT_FEATURES, *, min_extra: int = 2,
               weights: str = "relative") -> LinearStepModel:
    """Least-squares fit of a ``LinearStepModel`` to measured step times.

    Args:
      shapes: the measured steps' shapes.
      times_s: their durations (seconds), one per shape.
      features: the model's terms (names in ``FEATURES``).
      min_extra: points required beyond the number of coefficients (so residuals mean something).
      weights: "relative" minimises relative errors (rows divided by the measured time: short and
        long steps count alike), "absolute" plain least squares.

    Returns:
      The model; ``fit`` holds the residuals (per point, RMS and max relative error, R^2).

    Raises:
      ValueError: fewer than ``len(features) + min_extra`` points, lengths that differ, unknown
        features, non-positive or non-finite times, or a grid that does not determine every
        coefficient (rank-deficient: e.g. every point has the same number of sequences).
    """
    features = tuple(features)
    unknown = sorted(set(features) - set(FEATURES))
    if unknown or not features:
        raise ValueError(f"features={features}: unknown {unknown}; known: {sorted(FEATURES)}")
    if len(shapes) != len(times_s):
        raise ValueError(f"{len(shapes)} shapes but {len(times_s)} times")
    need = len(features) + min_extra
    if len(shapes) < need:
        raise ValueError(f"a grid of {len(shapes)} points is too small to fit {len(features)} "
                         f"coefficients ({', '.join(features)}): need at least {need}")
    y = np.asarray(times_s, np.float64)
    if not np.all(np.isfinite(y)) or np.any(y <= 0):
        raise ValueError("every measured time must be finite and > 0")
    X = np.array([[FEATURES[f](s) for f in features] for s in shapes], np.float64)
    scale = np.abs(X).max(axis=0)
    scale[scale == 0] = 1.0
    Xs = X / scale
    rank = np.linalg.matrix_rank(Xs)
    if rank < len(features):
        raise ValueError(f"the grid does not determine the fit: rank {rank} < {len(features)} "
                         f"coefficients ({', '.join(features)}); vary every feature")
    if weights not in ("relative", "absolute"):
        raise ValueError(f"weights={weights!r} must be 'relative' or 'absolute'")
    w = 1.0 / y if weights == "relative" else np.ones_like(y)
    beta, *_ = np.linalg.lstsq(Xs * w[:, None], y * w, rcond=None)
    beta = beta / scale
    pred = X @ beta
    rel = (pred - y) / y
    ss_res = float(((pred - y) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    fit = {"num_points": len(y), "features": list(features), "weights": weights,
           "rms_rel_error": float(np.sqrt((rel ** 2).mean())),
           "max_abs_rel_error": float(np.abs(rel).max()),
           "median_abs_rel_error": float(np.median(np.abs(rel))),
           "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else None,
           "residuals_s": (pred - y).tolist()}
    return LinearStepModel(coef=dict(zip(features, beta.tolist())), fit=fit)


# --- roofline (analytic) ---------------------------------------------------------------------
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
# (experiments/results/h200/README.md), not the 4.8 TB/s datasheet peak: a decode step is a
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
        m, d = self.model, self.device
        block = m.kv_bytes_per_block(self.block_size)
        moved = m.weight_bytes + m.kv_read_bytes(s.kv_read - s.kv_shared + s.num_tokens,
                                                 self.block_size) + 2 * block * s.copy_blocks
        flops = 2 * m.matmul_params * s.num_tokens + 2 * m.d_model * m.vocab_size * s.num_samples \
            + 4 * m.num_layers * m.num_heads * m.head_dim * s.attn_pairs
        dev = d.launch_s + max(moved / d.mem_bandwidth, flops / d.flop_s)
        if s.swap_blocks:  # over the host link, not overlapped with the step
            dev += block * s.swap_blocks / d.swap_bandwidth
        return d.host_s[0] + d.host_s[1] * s.num_seqs + dev

    def describe(self) -> dict:
        return {"name": self.name, "device": dataclasses.asdict(self.device),
                "model": dataclasses.asdict(self.model), "block_size": self.block_size,
                "form": "host0 + host1*seqs + launch + max(bytes/bandwidth, flops/flop_s)"}


# H200 NVLink 4: 900 GB/s per GPU over both directions (datasheet), so 450 GB/s each way; the
# latency of one small all-reduce over 8 GPUs is an assumption (NCCL-class, not measured here).
H200_NVLINK_BW = 450e9
ALLREDUCE_LATENCY_S = 10e-6


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


# --- noise ------------------------------------------------------------------------------
class NoisyStepModel(StepTimeModel):
    """``base.time(shape) * r``, ``r`` drawn i.i.d. from an empirical distribution of measured /
    predicted ratios (given as quantiles; inverse-CDF sampling with a seeded generator).

    A machine shared with other work stretches some steps far beyond the typical one; a fit
    reproduces the mean step, not that spread, so tail latencies (p99) come out too low. This
    puts the measured spread back: the calibration stores the quantiles of ``measured /
    predicted`` over its steps (``experiments/calibrate.py``, serving mode). Deterministic for a
    seed; the draws assume the ratio does not depend on the shape.
    """

    name = "noisy"

    def __init__(self, base: StepTimeModel, ratio_quantiles: Sequence[float], *, seed: int = 0):
        q = np.asarray(ratio_quantiles, np.float64)
        if q.ndim != 1 or len(q) < 2 or not np.all(np.isfinite(q)) or np.any(q < 0) \
                or np.any(np.diff(q) < 0):
            raise ValueError("ratio_quantiles must be >= 2 finite, non-negative, non-decreasing "
                             "values")
        self.base, self.q, self.seed = base, q, seed
        self._grid = np.linspace(0.0, 1.0, len(q))
        self._rng = np.random.default_rng(seed)
        self._buf, self._i = np.empty(0), 0

    def _ratio(self) -> float:
        if self._i >= len(self._buf):
            self._buf = np.interp(self._rng.random(4096), self._grid, self.q)
            self._i = 0
        r = self._buf[self._i]
        self._i += 1
        return float(r)

    def time(self, shape: StepShape) -> float:
        return self.base.time(shape) * self._ratio()

    def describe(self) -> dict:
        return {"name": self.name, "base": self.base.describe(), "seed": self.seed,
                "ratio_quantiles": {"p1": float(np.interp(0.01, self._grid, self.q)),
                                    "p50": float(np.interp(0.5, self._grid, self.q)),
                                    "p99": float(np.interp(0.99, self._grid, self.q)),
                                    "mean": float(np.trapezoid(self.q, self._grid))}}


def ratio_quantiles(measured: Sequence[float], predicted: Sequence[float], n: int = 257) -> list:
    """``n`` evenly spaced quantiles (0 .. 1) of ``measured / predicted``."""
    r = np.asarray(measured, np.float64) / np.asarray(predicted, np.float64)
    return np.quantile(r, np.linspace(0.0, 1.0, n)).tolist()


# --- replay ----------------------------------------------------------------------------------
class ReplayStepModel(StepTimeModel):
    """Returns recorded durations in order, one per step; raises when they run out."""

    name = "replay"

    def __init__(self, durations_s: Sequence[float]):
        self.durations = [float(d) for d in durations_s]
        if any(not (d >= 0 and math.isfinite(d)) for d in self.durations):
            raise ValueError("durations must be finite and >= 0")
        self.i = 0

    def time(self, shape: StepShape) -> float:
        if self.i >= len(self.durations):
            raise RuntimeError(f"replay ran out of recorded steps after {self.i}")
        d = self.durations[self.i]
        self.i += 1
        return d

    def describe(self) -> dict:
        return {"name": self.name, "num_steps": len(self.durations)}


def load_model_json(d: Mapping) -> StepTimeModel:
    """A step-time model from its JSON (``LinearStepModel.to_json``; the calibration file holds
    it under ``"model"``)."""
    if "model" in d and isinstance(d["model"], Mapping):
        d = d["model"]
    return LinearStepModel.from_json(d)


__all__ = ["DEFAULT_FEATURES", "FEATURES", "H200", "LLAMA3_8B", "MISTRAL_7B", "MODELS", "QWEN25_7B",
           "DeviceSpec", "LinearStepModel", "ModelDims", "NoisyStepModel", "ReplayStepModel",
           "RooflineStepModel", "StepShape", "StepTimeModel", "fit_linear", "load_model_json",
           "ratio_quantiles"]
