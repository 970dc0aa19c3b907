"""The calls of `BlockManager`'s interface that move KV off the device: swap (preemption by
swapping to host slots, `paged.kv.blocks.swap`) and the host tier of evicted prefix-cache blocks
(`paged.kv.blocks.host_tier`).

`OffloadCalls` is mixed into `paged.kv.block_manager.BlockManager` and reads the parts that class
composes (annotated below); a mutating call ends with the manager's ``_end_call``.
"""

from __future__ import annotations

from collections.abc import Callable

from paged.kv.blocks.host_tier import HostTier, TierCopies
from paged.kv.blocks.swap import Swapper


class OffloadCalls:
    """Swap-out, swap-in and the host tier's per-sequence queries and copies."""

    # The parts the owning manager sets in its ``__init__``, and its end-of-call hook.
    _swap: Swapper
    _tier: HostTier | None
    _end_call: Callable[[], None]

    def swap_out(self, seq_id) -> list[tuple[int, int]] | None:
        """Moves ``seq_id`` to host slots for preemption by swapping.

        Returns:
          ``(device_page, host_slot)`` copies for the next step, or ``None`` (nothing changed) if
          host slots run out or the sequence was swapped in since the last ``begin_step`` (its
          swap-in copy has not run yet; free it or wait a step). The device pages are released
          (held until the step performing the copy completes).

        Raises:
          ValueError: unknown or already swapped-out ``seq_id``.
        """
        pairs = self._swap.swap_out(seq_id)
        self._end_call()
        return pairs

    def can_swap_in(self, seq_id) -> bool:
        """Whether ``swap_in`` would succeed now (ValueError if ``seq_id`` is not swapped out)."""
        return self._swap.can_swap_in(seq_id)

    def swap_in(self, seq_id) -> list[tuple[int, int]] | None:
        """Brings a swapped-out ``seq_id`` back into fresh device blocks.

        Returns:
          ``(host_slot, device_page)`` copies for the next step, or ``None`` (nothing changed) if
          the pool cannot hold it or it was swapped out since the last ``begin_step`` (its
          swap-out copy has not run yet). Its full blocks are keyed again at the next
          ``mark_computed`` after the copy ran.

        Raises:
          ValueError: unknown or resident ``seq_id``.
        """
        pairs = self._swap.swap_in(seq_id)
        self._end_call()
        return pairs

    # --- host tier -------------------------------------------------------------------------
    @property
    def num_host_tier_blocks(self) -> int:
        """Host-tier slots (0: no tier)."""
        return 0 if self._tier is None else self._tier.num_slots

    def is_loading(self, seq_id) -> bool:
        """Whether ``seq_id`` waits for its host-tier load (the copy step has not completed):
        it must not be scheduled yet. False without a tier."""
        return self._tier is not None and self._tier.is_loading(seq_id)

    def loading_tokens(self, seq_id) -> int:
        """Prompt tokens ``seq_id`` loads from the host tier (0 once loaded, or without one)."""
        return 0 if self._tier is None else self._tier.loading_tokens(seq_id)

    def take_tier_copies(self) -> TierCopies | None:
        """The host tier's offloads, loads and dead slots recorded since the last call, for the
        step about to launch (after ``begin_step``); ``None`` when there are none. The step
        applies them among its copies: offload reads first (before poison and writes), then
        loads."""
        return None if self._tier is None else self._tier.take_copies()

    def host_tier_stats(self) -> dict:
        """The tier's counters and slots per state (all ints); empty without a tier."""
        if self._tier is None:
            return {}
        return dict(self._tier.stats, num_blocks=self._tier.num_slots, **self._tier.counts())
