"""The layout of a step's sampling rows: ``smp`` i32[7, N] (sample_rows, top_k, seed,
sample_index, sample_pos, target, draft) and ``smp_f`` f32[2, N] (temperature, top_p), one
column per sample slot. `paged.step.batch.DeviceBatch` carries them; the engine's jitted sampler
(`paged.engine.device_step.make_sample_fn`) receives them alone. Both read them by these names."""

from __future__ import annotations


class SamplingRows:
    """Named views of ``self.smp`` / ``self.smp_f`` (module docstring)."""

    sample_rows = property(lambda self: self.smp[0])  # i32[N]: token row each sample slot reads
    top_k = property(lambda self: self.smp[1])  # i32[N]
    seed = property(lambda self: self.smp[2])  # i32[N]
    sample_index = property(lambda self: self.smp[3])  # i32[N]
    sample_pos = property(lambda self: self.smp[4])  # i32[N]: position of the sampled token
    target = property(lambda self: self.smp[5])  # i32[N]: token to score (-1: the sampled one)
    draft = property(lambda self: self.smp[6])  # i32[N]: proposed token to verify (-1: none)
    temperature = property(lambda self: self.smp_f[0])  # f32[N]
    top_p = property(lambda self: self.smp_f[1])  # f32[N]


class SamplingView(SamplingRows):
    """The sampling rows alone (as the jitted sampler gets them)."""

    __slots__ = ("smp", "smp_f")

    def __init__(self, smp, smp_f):
        self.smp, self.smp_f = smp, smp_f
