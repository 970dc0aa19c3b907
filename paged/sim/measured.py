"""Step-time models from measured steps: ``NoisyStepModel`` (another model's time times a ratio
drawn from a measured distribution, the spread a shared machine adds; ``ratio_quantiles`` builds
that distribution) and ``ReplayStepModel`` (recorded step durations, in order).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from paged.sim.step_model import StepShape, StepTimeModel


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
