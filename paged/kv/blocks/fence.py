"""The step fence: device step ids, copy holds and the quarantine of freed blocks and host slots.

A block whose last reference drops while a device step that may read it is in flight
(``begin`` .. ``complete``) is quarantined: not handed out, evicted or reported dead before that
step completes (``quarantine_steps`` widens the window; 0 disables it). Independently of that
window, a block that a returned copy still has to read or write is held until the step that
performs the copy completes; host slots likewise. So blocks reported dead never have a pending
copy, and the copies of one step may run in any order.
"""

from __future__ import annotations

from collections import deque

from paged.kv.blocks.pool import QUARANTINED, BlockPool


class StepFence:
    """Step ids, per-block and per-host-slot copy holds, and the quarantine.

    Args:
      pool: the block pool whose blocks it holds back.
      quarantine_steps: a block freed while steps are in flight is reusable once step
        ``last_begun + quarantine_steps - 1`` has completed (0 disables the window).
      num_host_blocks: host slots.
    """

    def __init__(self, pool: BlockPool, quarantine_steps: int, num_host_blocks: int):
        self.pool = pool
        self.quarantine_steps = quarantine_steps
        self.last_begun = -1
        self.last_completed = -1
        n = pool.num_blocks
        self.busy_until = [-1] * n  # step that performs a pending copy of this block
        self.copy_step = -1  # latest step given a copy to perform (any block)
        self.release_at = [-1] * n  # for quarantined blocks
        self.held: dict[int, list[int]] = {}  # release step -> quarantined blocks (lazy deletes)
        self.cow_src: dict[int, int] = {}  # CoW dst -> src for the copies of the coming step
        self.quarantined = 0  # blocks ever quarantined
        self.num_host_blocks = num_host_blocks
        self.host_free: deque[int] = deque(range(num_host_blocks))
        self.host_busy_until = [-1] * num_host_blocks
        self.host_held: dict[int, list[int]] = {}
        self.num_host_held = 0

    def begin(self) -> int:
        """The id of the step about to launch; copies recorded from now on belong to the next."""
        self.last_begun += 1
        self.cow_src.clear()
        return self.last_begun

    def complete(self, step_id: int) -> None:
        """Marks ``step_id`` (already begun) and every earlier step complete."""
        if step_id <= self.last_completed:
            return
        self.last_completed = step_id
        if self.held:
            state, release_at = self.pool.state, self.release_at
            for r in sorted(r for r in self.held if r <= step_id):
                # dict.fromkeys: a block revived by a prefix hit and freed again in the same
                # window (a sliding window recycles a hit's old blocks at once) is listed twice.
                due = [b for b in dict.fromkeys(self.held.pop(r))
                       if state[b] == QUARANTINED and release_at[b] == r]
                self.pool.num_held -= len(due)
                self.pool.make_reusable(due)
        if self.host_held:
            for r in sorted(r for r in self.host_held if r <= step_id):
                slots = self.host_held.pop(r)
                self.num_host_held -= len(slots)
                self.host_free.extend(slots)

    def hold_for_copy(self, blocks, host_slots=()) -> int:
        """Holds ``blocks`` and ``host_slots`` until the coming step (which copies them) completes;
        returns that step's id."""
        nxt = self.last_begun + 1
        busy = self.busy_until
        for b in blocks:
            busy[b] = nxt
        for h in host_slots:
            self.host_busy_until[h] = nxt
        self.copy_step = nxt
        return nxt

    def release(self, blocks) -> None:
        """Drops one reference to each of ``blocks`` in the order given (LRU order for cached
        ones); those left unreferenced are quarantined or become reusable."""
        dead = self.pool.deref(blocks)
        if not dead:
            return
        window = self.last_begun + self.quarantine_steps - 1 if self.quarantine_steps else -1
        done = self.last_completed
        if window <= done and self.copy_step <= done:  # nothing in flight: reusable now
            self.pool.make_reusable(dead)
            return
        busy, pool = self.busy_until, self.pool
        for b in dead:
            release = max(window, busy[b])
            if release > done:
                pool.quarantine(b)
                self.release_at[b] = release
                self.held.setdefault(release, []).append(b)
                self.quarantined += 1
            else:
                pool.make_reusable((b,))

    def take_host(self, n: int) -> list[int]:
        """``n`` free host slots (the caller checked there are enough)."""
        return [self.host_free.popleft() for _ in range(n)]

    def release_host(self, slots: list[int]) -> None:
        """Returns host slots, held while a copy that touches them is pending."""
        done = self.last_completed
        for h in slots:
            release = self.host_busy_until[h]
            if release > done:
                self.host_held.setdefault(release, []).append(h)
                self.num_host_held += 1
            else:
                self.host_free.append(h)
