"""The fitted step-time model: ``t = sum_i coef_i * feature_i(shape)``, fitted by least squares
to step times measured on a machine (``fit_linear``; ``experiments/calibrate.py`` measures them),
and the features it may use (``FEATURES``; the default form is ``t = a + b * tokens + c * seqs + d
* kv_read``). ``load_model_json`` reads a calibration file's model back.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from paged.sim.step_model import StepShape, StepTimeModel

FEATURES: dict[str, Callable[[StepShape], float]] = {}


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


def load_model_json(d: Mapping) -> StepTimeModel:
    """A step-time model from its JSON (``LinearStepModel.to_json``; the calibration file holds
    it under ``"model"``)."""
    if "model" in d and isinstance(d["model"], Mapping):
        d = d["model"]
    return LinearStepModel.from_json(d)
