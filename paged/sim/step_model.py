"""Step-time models: how long one engine step takes, from the step's shape alone.

The simulator replaces the device call (and the host time around it) with a model
``StepTimeModel.time(shape) -> seconds``. Four families share that interface:

* ``LinearStepModel`` (`paged.sim.linear_model`): ``t = sum_i coef_i * feature_i(shape)``,
  fitted by least squares to step times measured on a machine (``fit_linear``).
* ``RooflineStepModel`` (`paged.sim.roofline`): analytic, from a device's memory bandwidth and
  FLOP/s and a model's dimensions (`paged.sim.specs`: ``DeviceSpec``, ``ModelDims``):
  ``t = host(seqs) + launch + max(bytes / bandwidth, flops / flop_s)``.
* ``NoisyStepModel`` (`paged.sim.measured`): another model's time times a ratio drawn from a
  measured distribution (the spread a shared machine adds to each step).
* ``ReplayStepModel`` (`paged.sim.measured`): replays a list of recorded step durations in order
  (tests, what-ifs on a recorded run).

A ``StepShape`` is what a step does, counted from the batch the real ``BatchBuilder`` built (or
the simulator's light equivalent): tokens computed, sequences, decodes, prefill tokens, KV
positions read by attention (the sum of the sequences' KV lengths), the padded buckets, and the
pages moved by swap and copy-on-write.
"""

from __future__ import annotations

import dataclasses


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


__all__ = ["StepShape", "StepTimeModel"]
