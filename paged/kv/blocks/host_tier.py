"""The host tier: prefix-cache blocks the device pool evicted, kept in host slots and loaded back.

A second prefix cache under the device's, in host memory, with the same keys: its own
``PrefixCacheIndex`` over host slots (same digests, salts and full-key verification; a slot's
content version changes whenever it is given new content, so an entry made at an older version is
never served), its own free list and eviction order (the device pool's interface,
``paged.kv.blocks.eviction``; LRU by default). Bookkeeping only; the bytes move in the engine's device
step (``paged.kv.host_store``), in the order this part returns them.

Every slot is exactly one of:

* *free*: no content (only before the tier first fills up);
* *writing*: indexed, its offload copy belongs to step ``ready_at[slot]``; not loadable (and not
  evictable) before that step completes, but an eviction of an equal key is not copied again;
* *cached*: indexed, in the eviction order (``lru``), loadable;
* *held*: cached content a load of step ``held_until[slot]`` reads; out of the order (not evictable)
  until that step completes, still loadable by other admissions.

Migration rules (write-back): a device block is copied to the host only when the device pool
evicts it (``offer``, called by the pool's LRU eviction), unless an equal key is already in the
tier. The offload reads the device page in the step's copies before that step's poison and writes,
so the device block may be reused at once. A host hit is loaded into a fresh device block (held by
the step fence until the copy step completes); the host copy stays (the tier is inclusive), so a
later eviction of the loaded block costs no copy.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Hashable

from paged.kv.blocks.eviction.lru import LRUOrder
from paged.kv.blocks.prefix_index import BlockKey, PrefixCacheIndex, PrefixKeyer

FREE, WRITING, CACHED, HELD = 0, 1, 2, 3
STATE_NAMES = ("free", "writing", "cached", "held")


@dataclasses.dataclass
class TierCopies:
    """The host tier's copies for one step: ``offload`` ``(device_page, host_slot)`` pairs (read
    the page before anything else of the step writes it), ``load`` ``(host_slot, device_page)``
    pairs, and ``died`` host slots whose content was evicted (debug: poison them before the
    step's offloads write them again)."""

    offload: list[tuple[int, int]]
    load: list[tuple[int, int]]
    died: list[int]

    def __bool__(self) -> bool:
        return bool(self.offload or self.load or self.died)


class HostTier:
    """Host slots, their index, eviction order and states, and the loads of sequences (module
    docstring).

    Args:
      num_slots: host slots (each holds one block: every layer, every KV head, values and scales).
      keyer: the device's prefix keyer (its block size, hash function and enabled flag).
      fence: the step fence (step ids; device pages a load writes are held for the copy).
      order: the slots' eviction order, built for ``num_slots`` slots over this tier's index
        (``order(index)``); None: LRU.
    """

    def __init__(self, num_slots: int, keyer: PrefixKeyer, fence, order=None):
        self.num_slots = num_slots
        self.keyer = keyer
        self.fence = fence
        self.index = PrefixCacheIndex(num_slots)
        self.version = [0] * num_slots
        self.state = [FREE] * num_slots
        self.free: deque[int] = deque(range(num_slots))
        self.lru = LRUOrder() if order is None else order(self.index)  # cached slots
        self.ready_at = [-1] * num_slots  # writing: the step whose copies write the slot
        self.held_until = [-1] * num_slots  # held: the step whose copies read the slot
        self.waiting: list[int] = []  # writing or held slots (lazy: checked at ``complete``)
        self.loading: dict[Hashable, tuple[int, int]] = {}  # seq id -> (load step, tokens)
        self._offload: list[tuple[int, int]] = []
        self._load: list[tuple[int, int]] = []
        self._died: list[int] = []
        self.stats = {"hit_tokens": 0, "hits": 0, "offloaded_blocks": 0, "loaded_blocks": 0,
                      "deduplicated_blocks": 0, "dropped_blocks": 0, "evicted_blocks": 0}

    # --- offload ---------------------------------------------------------------------------
    def offer(self, block: int, key: BlockKey) -> None:
        """The device pool evicts ``block`` (keyed ``key``): copy it to a host slot in the coming
        step, unless an equal key is in the tier already (then it only becomes most recent) or
        every slot is writing or held (then it is dropped, as without a tier)."""
        slot = self.index.find(key.digest, key.parent, key.data, key.salt, self.version)
        if slot is not None:
            if self.state[slot] == CACHED:
                self.lru.touch(slot)
            self.stats["deduplicated_blocks"] += 1
            return
        if self.free:
            slot = self.free.popleft()
        elif self.lru:
            slot, digest = self.lru.evict_one()
            self.index.remove(slot, digest)
            self._died.append(slot)
            self.stats["evicted_blocks"] += 1
        else:
            self.stats["dropped_blocks"] += 1
            return
        self.version[slot] += 1
        if self.lru.on_take is not None:
            self.lru.on_take((slot,))
        self.index.add(slot, key, self.version[slot])
        self.state[slot] = WRITING
        self.ready_at[slot] = self.fence.last_begun + 1
        self.waiting.append(slot)
        self._offload.append((block, slot))
        self.stats["offloaded_blocks"] += 1

    # --- load ------------------------------------------------------------------------------
    def match(self, tokens: list[int], salt: bytes, device_hits: list[tuple[int, BlockKey]]
              ) -> list[tuple[int, BlockKey]]:
        """(slot, key) of the loadable slots holding the full blocks of ``tokens`` right after
        ``device_hits`` (never the block holding the final token). Read only."""
        keyer = self.keyer
        if not keyer.enabled or not self.index:
            return []
        B, digest, find, state = keyer.block_size, keyer.digest, self.index.find, self.state
        pack = keyer.pack
        parent = device_hits[-1][1] if device_hits else None
        hits = []
        for i in range(len(device_hits), (len(tokens) - 1) // B):
            data = pack(*tokens[i * B:(i + 1) * B])
            slot = find(digest(None if parent is None else parent.digest, data, salt), parent,
                        data, salt, self.version)
            if slot is None or state[slot] == WRITING:
                break
            parent = self.index.key[slot]
            hits.append((slot, parent))
        return hits

    def hold(self, hits: list[tuple[int, BlockKey]]) -> None:
        """Keeps the slots of ``hits`` (from ``match``) out of the LRU until the coming step
        completes, so that allocating the device pages they load into cannot evict them."""
        state, held_until, lru = self.state, self.held_until, self.lru
        step = self.fence.last_begun + 1
        on_hit = lru.on_hit
        for slot, _ in hits:
            if on_hit is not None:
                on_hit(slot)
            if state[slot] == CACHED:
                del lru[slot]
                state[slot] = HELD
                self.waiting.append(slot)
            held_until[slot] = step

    def load(self, seq_id, hits: list[tuple[int, BlockKey]], pages: list[int]) -> None:
        """``seq_id`` loads the slots of ``hits`` (``hold`` first) into the fresh device ``pages``
        in the coming step: one batched copy with the step's other loads; the fence holds the
        pages until that step completes."""
        step = self.fence.hold_for_copy(pages)
        self._load.extend((slot, page) for (slot, _), page in zip(hits, pages, strict=True))
        self.loading[seq_id] = (step, len(hits) * self.keyer.block_size)
        self.stats["hits"] += len(hits)
        self.stats["hit_tokens"] += len(hits) * self.keyer.block_size
        self.stats["loaded_blocks"] += len(hits)

    def is_loading(self, seq_id) -> bool:
        """Whether ``seq_id``'s load copy has not completed yet."""
        entry = self.loading.get(seq_id)
        if entry is None:
            return False
        if entry[0] > self.fence.last_completed:
            return True
        del self.loading[seq_id]
        return False

    def loading_tokens(self, seq_id) -> int:
        """Tokens ``seq_id`` loads (0 if it loads nothing or its load completed)."""
        return self.loading[seq_id][1] if self.is_loading(seq_id) else 0

    def forget(self, seq_id) -> None:
        """``seq_id`` left (freed); its pages and slots stay held until the load step completes."""
        self.loading.pop(seq_id, None)

    # --- steps -----------------------------------------------------------------------------
    def take_copies(self) -> TierCopies | None:
        """The copies recorded since the last call (for the step about to launch), or ``None``."""
        if not (self._offload or self._load or self._died):
            return None
        out = TierCopies(self._offload, self._load, self._died)
        self._offload, self._load, self._died = [], [], []
        return out

    def complete(self, step_id: int) -> None:
        """Step ``step_id`` (and every earlier one) completed: slots it wrote or read are cached."""
        if not self.waiting:
            return
        state, lru, key = self.state, self.lru, self.index.key
        keep = []
        for slot in self.waiting:
            st = state[slot]
            if (self.ready_at[slot] if st == WRITING else self.held_until[slot]) > step_id:
                keep.append(slot)
            elif st != CACHED:
                state[slot] = CACHED
                lru[slot] = key[slot].digest
        self.waiting = keep

    # --- queries ---------------------------------------------------------------------------
    def counts(self) -> dict:
        """Slots per state (all ints)."""
        held = sum(1 for s in self.waiting if self.state[s] == HELD)
        writing = sum(1 for s in self.waiting if self.state[s] == WRITING)
        return {"free": len(self.free), "cached": len(self.lru), "writing": writing, "held": held}

    def check(self) -> None:
        """Raises AssertionError if the tier is inconsistent (O(slots))."""
        counts = [0] * 4
        free, waiting = set(self.free), set(self.waiting)
        if len(waiting) != len(self.waiting):
            raise AssertionError("host tier: a slot waits twice")
        for slot in range(self.num_slots):
            st = self.state[slot]
            counts[st] += 1
            keyed = self.index.key[slot] is not None
            if (st == FREE) != (slot in free) or (st == FREE) == keyed:
                raise AssertionError(f"host slot {slot} state {STATE_NAMES[st]} keyed={keyed} "
                                     f"free={slot in free}")
            if (st == CACHED) != (slot in self.lru) or (st in (WRITING, HELD)) != (slot in waiting):
                raise AssertionError(f"host slot {slot} state {STATE_NAMES[st]} disagrees with "
                                     f"the LRU / waiting list")
            if st == CACHED and self.lru[slot] != self.index.key[slot].digest:
                raise AssertionError(f"host slot {slot} waits in the LRU under a wrong digest")
        if sum(counts) != self.num_slots:
            raise AssertionError(f"host tier state counts {counts} != {self.num_slots} slots")
        self.index.check(self.version)
