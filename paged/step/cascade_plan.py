"""Cascade attention on the host: finding shared-prefix groups in a decode step and deciding
whether reading their prefixes once pays (``EngineConfig(cascade_attention=...)``).

Groups come from the block tables the batch already holds: running decodes whose tables start
with the same physical block share content there (prefix caching hands out a cached block only
for an equal token prefix, a fork shares its parent's blocks, and copy-on-write separates a
block before anyone writes into it). A group is every decode whose first block is the same; its
prefix is the longest run of leading blocks all its members hold, cut to the whole blocks before
every member's newest token (the token written this step is never in a shared prefix). A
decode-only step gets ``AttentionMetadata.cascade`` (fixed shape ``[max_groups, S + 1]``, padded
groups) and the model attends with ``pallas_kernels.cascade_paged_attention``; a step with a
prefill chunk or a verification runs ordinary ragged attention. The choice never changes what
attention computes, only how often a prefix is read (outputs equal to float rounding).

The cost rule (``CascadeCost``, the one place its constants live): per layer and KV head, a group
of ``n`` members sharing ``p`` tokens saves ``(n - 1) * p`` token reads; a cascade step also pays
a second pass and a merge, a fixed cost expressed as ``overhead_tokens`` token reads. "auto" takes
the groups with ``n >= 2`` and ``(n - 1) * p >= min_group_saving_tokens`` and runs cascade when
their total saving is at least ``overhead_tokens``; "on" takes every group of two or more sharing
at least one full block; "off" never runs it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

MODES = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class CascadeCost:
    """The constants of the cascade decision (token reads per layer and KV head).

    Defaults measured for the "xla" path on CPU only (GPU and TPU were not measured; their
    crossover may differ: the opt-in ``cascade`` stage of ``experiments/device_check.sh`` is the
    H200 measurement, not run yet), by
    ``experiments/cascade.py`` (committed run: ``experiments/results/archive/cascade/cascade.json``, JAX
    0.10.2 on 2 shared CPU cores, one group per step, groups of 1-16 sharing 64-1,024 tokens with
    16-token suffixes, Hq=8, Hkv=2, D=64, page 16, float32). The study fits
    ``t_cascade - t_ordinary = a - b * saved`` over the 20 points with two or more members
    (``saved = (members - 1) * prefix tokens``): ``a`` = 44.5 us fixed extra cost, ``b`` = 76 ns per
    saved token read (times are per layer call on those shapes), so cascade breaks even at
    ``a / b`` = 583 saved token reads; ``overhead_tokens`` is that rounded up to whole pages (592).
    The observed crossovers (smallest prefix from which cascade was faster, median over rounds, at
    every longer prefix) were saving 256 (groups of 2), 384 (4), 3,584 (8) and 1,920 (16) token
    reads: noisy (the fit's RMS residual is 132 us, per-round IQRs are wide), so the constant is
    the fit, not any single crossover. Groups of 1 (no saving) ran 0.86-1.12x ordinary.
    ``min_group_saving_tokens`` is not measured (the study times one group per step; a step's
    group slots are a fixed shape, so an extra group adds no pass): it only keeps groups saving
    less than 64 token reads out. Neither constant changes outputs.

    Attributes:
      overhead_tokens: the fixed cost of a cascade step (second pass, merge, gathers of the group
        rows) expressed as token reads it must save to break even.
      min_group_saving_tokens: a group is worth taking when it saves at least this many token
        reads ((members - 1) * prefix tokens).
      max_groups: groups a step carries (the metadata's fixed first dimension, capped by half the
        sequence bucket); the groups saving most are kept.
    """

    overhead_tokens: int = 592  # experiments/results/cascade: the XLA/CPU break-even fit
    min_group_saving_tokens: int = 64
    max_groups: int = 8

    def __post_init__(self):
        for name in ("overhead_tokens", "min_group_saving_tokens", "max_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}={value!r} must be a non-negative int")
        if self.max_groups < 1:
            raise ValueError(f"max_groups={self.max_groups} must be >= 1")


def find_groups(tables: np.ndarray, kv_lens: np.ndarray, page_size: int) -> list[tuple[list[int], int]]:
    """The shared-prefix groups of a decode batch.

    Args:
      tables: i32[S, pages_per_seq] block table of each decode (``NULL_PAGE`` past its blocks).
      kv_lens: i32[S] tokens of each decode after this step (its newest at ``kv_lens - 1``).
      page_size: tokens per block.

    Returns:
      ``(members, prefix_blocks)`` per group of two or more rows whose tables start with the same
      block, ``prefix_blocks >= 1`` the leading blocks all members hold and none of them writes
      this step; members in row order, groups ordered by their first member.
    """
    tables = np.asarray(tables)
    usable = (np.asarray(kv_lens, np.int64) - 1) // page_size  # whole blocks before the newest
    rows = np.flatnonzero(usable >= 1)
    groups = []
    if len(rows) < 2:
        return groups
    first = tables[rows, 0]
    order = np.argsort(first, kind="stable")
    starts = np.flatnonzero(np.diff(first[order], prepend=-1))
    for lo, hi in zip(starts, [*starts[1:], len(order)]):
        if hi - lo < 2:
            continue
        members = np.sort(rows[order[lo:hi]])
        limit = int(usable[members].min())
        block = tables[members, :limit]
        same = np.all(block == block[:1], axis=0)
        prefix = limit if same.all() else int(np.argmin(same))
        groups.append((members.tolist(), prefix))
    groups.sort(key=lambda g: g[0][0])
    return groups


class CascadePlanner:
    """Chooses, per decode-only step, the groups cascade attention serves; counts what it did.

    ``plan`` returns the step's packed metadata (i32[G, S + 1]: column 0 the group's shared
    tokens, then its member rows, -1 padded; G = ``min(cost.max_groups, max(1, S // 2))``) or
    None for an ordinary step.
    """

    def __init__(self, mode: str, page_size: int, cost: CascadeCost | None = None):
        if mode not in MODES:
            raise ValueError(f"cascade_attention={mode!r} must be one of {MODES}")
        self.mode = mode
        self.page_size = page_size
        self.cost = cost or CascadeCost()
        self.steps = 0
        self.groups = 0
        self.prefix_tokens_shared = 0  # prefix tokens not re-read: sum of (members - 1) * prefix

    def num_groups(self, s_pad: int) -> int:
        """The metadata's fixed number of group slots for a sequence bucket."""
        return min(self.cost.max_groups, max(1, s_pad // 2))

    def choose(self, groups: list[tuple[list[int], int]]) -> list[tuple[list[int], int]]:
        """The groups worth serving under the mode and the cost rule (possibly none)."""
        if self.mode == "off":
            return []
        if self.mode == "on":
            return [g for g in groups if len(g[0]) >= 2 and g[1] >= 1]
        ps, cost = self.page_size, self.cost
        worth = [g for g in groups if (len(g[0]) - 1) * g[1] * ps >= cost.min_group_saving_tokens]
        saved = sum((len(m) - 1) * p * ps for m, p in worth)
        return worth if worth and saved >= cost.overhead_tokens else []

    def select(self, tables: np.ndarray, kv_lens: np.ndarray,
               s_pad: int) -> list[tuple[list[int], int]]:
        """The groups ``plan`` serves in a decode-only step (``find_groups``'s ``(members,
        prefix_blocks)``, chosen by the mode and the cost rule, the ``num_groups(s_pad)`` saving
        most), counting nothing: also what the simulator prices (``paged.sim``)."""
        if self.mode == "off" or s_pad < 2:
            return []
        chosen = self.choose(find_groups(tables, kv_lens, self.page_size))
        return sorted(chosen, key=lambda g: -(len(g[0]) - 1) * g[1])[:self.num_groups(s_pad)]

    def plan(self, tables: np.ndarray, kv_lens: np.ndarray, s_pad: int) -> np.ndarray | None:
        """The metadata of a decode-only step of ``len(kv_lens)`` rows in a bucket of ``s_pad``,
        or None; counts the step when cascade is used."""
        chosen = self.select(tables, kv_lens, s_pad)
        if not chosen:
            return None
        slots = self.num_groups(s_pad)
        ps = self.page_size
        meta = np.full((slots, s_pad + 1), -1, np.int32)
        meta[:, 0] = 0
        for g, (members, prefix) in enumerate(chosen):
            meta[g, 0] = prefix * ps
            meta[g, 1:1 + len(members)] = members
        self.count(chosen)
        return meta

    def count(self, chosen: list[tuple[list[int], int]]) -> None:
        """Counts a cascade step serving ``chosen`` (``select``'s groups): ``plan`` does, and a
        simulator that prices the step without building its metadata."""
        self.prefix_tokens_shared += sum((len(m) - 1) * p for m, p in chosen) * self.page_size
        self.steps += 1
        self.groups += len(chosen)

    def stats(self) -> dict:
        """``{"mode", "steps", "groups", "prefix_tokens_shared"}`` counted so far: cascade steps,
        groups served (summed over steps) and prefix token reads saved per layer and KV head
        (``(members - 1) * prefix tokens``, summed over groups and steps)."""
        return {"mode": self.mode, "steps": self.steps, "groups": self.groups,
                "prefix_tokens_shared": self.prefix_tokens_shared}
