"""Arrival processes and length distributions of constructed workloads (see `paged.workload.workload`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from paged.util import validate

REFERENCE_CONTEXT_LEN = 2048  # context length of the models served in the PagedAttention paper.
SeedLike = int | np.random.SeedSequence


@dataclasses.dataclass(frozen=True)
class LengthProfile:
    """A constructed lognormal length distribution with the dataset's reported means.

    Attributes:
      name: dataset it imitates.
      mean_prompt: mean input tokens reported for the dataset.
      mean_output: mean output tokens reported for the dataset.
      sigma_prompt: lognormal shape of prompt lengths (our choice, not a fit).
      sigma_output: lognormal shape of output lengths (our choice, not a fit).
      source: where the means come from.
    """

    name: str
    mean_prompt: float
    mean_output: float
    sigma_prompt: float
    sigma_output: float
    source: str = "PagedAttention (Kwon et al., SOSP 2023), dataset means; sigma chosen, not fitted"


SHAREGPT = LengthProfile("sharegpt", 161.31, 337.99, 1.0, 1.0)
ALPACA = LengthProfile("alpaca", 19.31, 58.45, 0.7, 0.7)
PROFILES = {p.name: p for p in (SHAREGPT, ALPACA)}


def _check_positive_rate(rate: Any) -> float:
    try:
        return validate.real("rate", rate, minimum=0, exclusive=True, allow_inf=True)
    except ValueError as e:
        raise ValueError(f"{e} requests/s (inf = all at once)") from None



# --- arrival processes -----------------------------------------------------------------------
def gamma_arrivals(rate: float, num: int, *, burstiness: float = 1.0, seed: SeedLike) -> np.ndarray:
    """Arrival times with gamma inter-arrival gaps (shape ``burstiness``, mean ``1 / rate``).

    Args:
      rate: mean requests per second, > 0; ``inf`` puts every arrival at 0.
      num: number of requests, >= 1.
      burstiness: gamma shape k > 0; 1 = Poisson, < 1 burstier (CV = 1 / sqrt(k)).
      seed: int or SeedSequence.

    Returns:
      f64[num] arrival times, the first at 0, non-decreasing.

    Raises:
      ValueError / TypeError: rate <= 0, num < 1, burstiness <= 0.
    """
    rate = _check_positive_rate(rate)
    num = validate.integer("num", num, minimum=1)
    validate.real("burstiness", burstiness, minimum=0, exclusive=True)
    if math.isinf(rate):
        return np.zeros(num)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def poisson_arrivals(rate: float, num: int, *, seed: SeedLike) -> np.ndarray:
    """Poisson arrivals: exponential gaps with mean ``1 / rate``; see `gamma_arrivals`."""
    rate = _check_positive_rate(rate)
    num = validate.integer("num", num, minimum=1)
    if math.isinf(rate):
        return np.zeros(num)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def fixed_arrivals(times: Iterable[float]) -> np.ndarray:
    """Given arrival times as f64[num], checked finite, >= 0 and non-decreasing."""
    t = np.asarray(list(times), dtype=np.float64)
    if t.ndim != 1 or t.size == 0:
        raise ValueError(f"times must be a non-empty 1-D sequence, got shape {t.shape}")
    bad = np.flatnonzero(~np.isfinite(t) | (t < 0))
    if bad.size:
        raise ValueError(f"times[{bad[0]}]={t[bad[0]]} must be finite and >= 0")
    back = np.flatnonzero(np.diff(t) < 0)
    if back.size:
        i = back[0] + 1
        raise ValueError(f"times[{i}]={t[i]} < times[{i - 1}]={t[i - 1]}; must be non-decreasing")
    return t


# --- lengths and prompts ---------------------------------------------------------------------
def length_scale(max_model_len: int) -> float:
    """The linear scale rule: ``max_model_len / REFERENCE_CONTEXT_LEN``."""
    return validate.integer("max_model_len", max_model_len, minimum=2) / REFERENCE_CONTEXT_LEN


def profile_lengths(profile: LengthProfile, num: int, *, max_model_len: int, seed: SeedLike,
                    reserved: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Scaled, clipped lognormal lengths of ``profile``.

    Args:
      profile: target means and sigmas.
      num: number of requests, >= 1.
      max_model_len: context window; lengths are scaled by `length_scale` and clipped to fit.
      seed: int or SeedSequence.
      reserved: prompt tokens every request also carries (a shared prefix), excluded from the draw.

    Returns:
      ``(prompt_lens, output_lens)``, i64[num] each: own prompt tokens (BOS included, >= 1) and
      output tokens (>= 1), with ``reserved + prompt + output <= max_model_len``.

    Raises:
      ValueError: num < 1 or ``reserved + 2 > max_model_len``.
    """
    num = validate.integer("num", num, minimum=1)
    scale = length_scale(max_model_len)
    reserved = validate.integer("reserved", reserved, minimum=0)
    if reserved + 2 > max_model_len:
        raise ValueError(f"shared prefix of {reserved} tokens leaves no room for a 1-token prompt "
                         f"and a 1-token output in max_model_len={max_model_len}")
    rng = np.random.default_rng(seed)
    prompt = _lognormal(rng, profile.mean_prompt * scale, profile.sigma_prompt, num)
    output = _lognormal(rng, profile.mean_output * scale, profile.sigma_output, num)
    prompt = np.clip(prompt, 1, max_model_len - reserved - 1)
    output = np.clip(output, 1, max_model_len - reserved - prompt)
    return prompt, output


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, num: int) -> np.ndarray:
    mu = math.log(mean) - sigma**2 / 2
    return np.rint(rng.lognormal(mu, sigma, size=num)).astype(np.int64)


def sharegpt_like_lengths(num: int, *, max_model_len: int, seed: SeedLike,
                          reserved: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """ShareGPT-like lengths (means 161.31 / 337.99 before scaling); see `profile_lengths`."""
    return profile_lengths(SHAREGPT, num, max_model_len=max_model_len, seed=seed, reserved=reserved)


def alpaca_like_lengths(num: int, *, max_model_len: int, seed: SeedLike,
                        reserved: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Alpaca-like lengths (means 19.31 / 58.45 before scaling); see `profile_lengths`."""
    return profile_lengths(ALPACA, num, max_model_len=max_model_len, seed=seed, reserved=reserved)


def synthetic_prompt(length: int, *, rng: np.random.Generator, vocab: int = 256) -> tuple[int, ...]:
    """``length`` random token ids in ``[0, vocab)`` (byte tokens; no BOS, the caller adds it)."""
    length = validate.integer("length", length, minimum=0)
    vocab = validate.integer("vocab", vocab, minimum=1)
    return tuple(int(t) for t in rng.integers(0, vocab, size=length))


def constructed_arrivals(num, rate, burstiness, arrival_times, ss) -> np.ndarray:
    """``make_workload``'s arrival times: ``arrival_times`` as given, or a gamma process at
    ``rate`` (exactly one of the two)."""
    if arrival_times is not None:
        if rate is not None:
            raise ValueError(f"give rate or arrival_times, not both (rate={rate!r})")
        t = fixed_arrivals(arrival_times)
        if t.size != num:
            raise ValueError(f"{t.size} arrival_times for num_requests={num}")
        return t
    if rate is None:
        raise ValueError("rate=None needs arrival_times")
    return gamma_arrivals(rate, num, burstiness=burstiness, seed=ss)


def constructed_lengths(kind, num, max_model_len, prefix, prompt_len, output_len, ss):
    """``make_workload``'s (prompt lengths, output lengths, their meta) for ``kind``: fixed, or a
    profile's distribution scaled to ``max_model_len`` with ``prefix`` positions reserved."""
    if kind == "fixed":
        p = validate.integer("prompt_len", prompt_len, minimum=1)
        o = validate.integer("output_len", output_len, minimum=1)
        max_model_len = validate.integer("max_model_len", max_model_len, minimum=2)
        if prefix + p + o > max_model_len:
            raise ValueError(f"shared prefix {prefix} + prompt_len={p} + output_len={o} > "
                             f"max_model_len={max_model_len}")
        return np.full(num, p), np.full(num, o), {"lengths": "fixed"}
    if prompt_len is not None or output_len is not None:
        raise ValueError(f"prompt_len={prompt_len!r}, output_len={output_len!r}: only kind='fixed'")
    profile = PROFILES[kind]
    prompts, outputs = profile_lengths(profile, num, max_model_len=max_model_len, seed=ss,
                                       reserved=prefix)
    meta = {"lengths": {**dataclasses.asdict(profile), "distribution": "lognormal, rounded",
                        "scale_rule": f"linear: max_model_len / {REFERENCE_CONTEXT_LEN}",
                        "scale": length_scale(max_model_len),
                        "clip": "prompt to [1, max_model_len - prefix - 1], "
                                "output to [1, max_model_len - prompt_len]",
                        "realised_mean_prompt": float(prompts.mean()),
                        "realised_mean_output": float(outputs.mean())}}
    return prompts, outputs, meta
