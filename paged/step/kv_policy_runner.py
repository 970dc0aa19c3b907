"""When a KV policy runs, and the host's bookkeeping of each call (pure Python, no JAX).

At the start of every step (before scheduling, so the pages freed serve this step), each
running sequence whose computed count reached its next policy point (the prompt's end, then
every ``interval`` tokens) and whose every slot was written by a step already dispatched gets one
call: the policy's ``keep_count`` says how many slots survive, the block manager shrinks the
table (`paged.kv.blocks.compact`), the input-batch row learns the new ``dropped`` count (slot =
position - dropped) and the engine gets a ``CompactOp`` to run on device before anything else of
the step (`paged.engine.kv_compact`). A simulator gets the same ops (and prices them).
"""

from __future__ import annotations

from typing import NamedTuple

from paged.config.kv_policy import KVPolicyConfig
from paged.kv import policies
from paged.kv.blocks.compact import Compaction
from paged.kv.policies import KVPolicy

NEVER = 2**31 - 1


class PosRecord:
    """A holder of one compacted sequence's device record of its slots' original positions
    (``arrays``: set by the engine, ``paged.engine.kv_compact``; None in a simulator) and, with
    per-layer budgets, of the slots each layer hides (``holes``: i32[L, 2], layer l does not
    see slots [lo, hi); None: none). Held by ``Sequence.kv_pos_key`` (shared by its forks), so
    it lives exactly as long as a sequence uses it."""

    __slots__ = ("arrays", "holes")

    def __init__(self, holes=None):
        self.arrays = None
        self.holes = holes


class CompactOp(NamedTuple):
    """One sequence's compaction for the device."""

    seq_id: int
    plan: Compaction
    start: int  # slot index of the region's first slot (blocks before it are shared, kept)
    dropped_before: int  # positions dropped before this call (slot j holds position j + this)
    pos_src: PosRecord | None  # the record of the slots before (None: slot j is position j)
    pos_dst: PosRecord  # where the new record goes
    layer_kept: tuple | None = None  # per layer, slots of the region kept (None: plan.num_kept)


class KVPolicyRunner:
    """Runs one ``KVPolicy`` over the input batch's rows (see the module docstring).

    Args:
      policy: the method.
      interval: computed tokens between calls after the prompt's (0: the prompt's end only).
      batch: the input batch; block_manager: its block manager.
    """

    def __init__(self, policy: KVPolicy, interval: int, batch, block_manager,
                 num_layers: int = 1):
        self.policy = policy
        self.num_layers = num_layers
        self.mass = policy.mass_window is not None  # the cache keeps each slot's attention mass
        self.interval = interval
        self.ib = batch
        self.bm = block_manager
        self.calls = 0  # policy calls (a call may drop nothing)
        self.compactions = 0  # calls that dropped tokens
        self.tokens_dropped = 0  # slots dropped (per layer and KV head)
        self.pages_freed = 0
        self.slots_hidden = 0  # slots kept in pages but hidden from a layer (per-layer budgets)

    @classmethod
    def build(cls, config: KVPolicyConfig | None, core) -> KVPolicyRunner | None:
        """The runner of a ``HostCore`` (None without a policy); tells its batch builder and
        step reader that slots are positions minus ``dropped`` from now on."""
        if config is None:
            return None
        core.builder.kv_offsets = core.reader.kv_offsets = True
        policy = policies.build(config)
        core.builder.mass_window = policy.mass_window  # which queries the mass counts
        num_layers = core.kv_spec.model.num_layers
        if policy.per_layer:
            core.builder.hole_layers = num_layers
        return cls(policy, config.interval, core.batch, core.block_manager, num_layers)

    def plan(self) -> list[CompactOp]:
        """The calls due now, applied on the host; their device halves, in order."""
        ib, ops, B = self.ib, [], self.bm.block_size
        for r in range(ib.num_rows):
            seq = ib.seqs[r]
            nc = int(ib.num_computed[r])
            at = seq.kv_next if seq.kv_next >= 0 else int(ib.num_prompt[r])
            if nc < at or ib.num_slots[r] != nc:
                continue
            self.calls += 1
            seq.kv_next = nc + self.interval if self.interval else NEVER
            d = int(ib.dropped[r])
            keeps = self.policy.layer_keep(nc, self.num_layers)
            slots, keep = nc - d, max(keeps)
            if keep >= slots:
                continue
            plan = self.bm.compact(seq.seq_id, keep)
            if plan is None:
                continue
            start = plan.first_block * B
            gone = slots - start - plan.num_kept
            ib.dropped[r] = d + gone
            ib.num_blocks[r] = -1  # its table row is refreshed when it next runs
            kept = [min(plan.num_kept, max(k - start, 1)) for k in keeps]
            holes = None
            if min(kept) < plan.num_kept:  # the smaller layers hide their other slots
                holes = [[start + k, start + plan.num_kept] for k in kept]
                self.slots_hidden += sum(plan.num_kept - k for k in kept)
            record = PosRecord(holes)
            ops.append(CompactOp(seq.seq_id, plan, start, d, seq.kv_pos_key, record,
                                 None if holes is None else tuple(kept)))
            seq.kv_pos_key = record
            self.compactions += 1
            self.tokens_dropped += gone
            self.pages_freed += plan.freed
        return ops

    def stats(self) -> dict:
        """``kv_stats()["kv_policy"]``: the method and its counters since construction."""
        return {"method": self.policy.name, "calls": self.calls, "compactions": self.compactions,
                "tokens_dropped": self.tokens_dropped, "pages_freed": self.pages_freed,
                "slots_hidden": self.slots_hidden}


__all__ = ["NEVER", "CompactOp", "KVPolicyRunner", "PosRecord"]
