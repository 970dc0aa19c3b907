"""Open pages of packed (int4 / int2, KIVI) KV: which full-precision slot holds each open page.

A packed page is quantized when it fills (keys per channel need every token of the page), so a
sequence's last, partially filled page -- its *open page* -- is held in the model dtype in a
side buffer of ``num_slots`` page-sized slots beside the packed pool (``KVCache.open_k`` /
``open_v``). **The owner of a slot is the physical page** that is open: the slot is found by the
page id in the sequence's block table, so every mechanism that moves a page by id moves its slot
with it the same way. Copy-on-write of a shared open page (``copy``) copies its slot to a fresh
slot of the destination page; two sequences sharing an open page (forked samples, before either
writes) share its slot. Swap moves a swapped page's slot content to the host with it
(``swap_out`` / ``keep``, by host slot) and back into a fresh slot (``swap_in``). A slot is released when its page closes (``plan``) or when its page is
no longer in use (``in_use(page)`` false: the sequence finished or was preempted; checked when
slots run short). A stale mapping is harmless: a page is written from offset 0 whenever a
sequence starts it, and only offsets written since then are read.

``plan`` turns one step's metadata (host numpy) into the index arrays the device step needs
(``paged.models.kivi_attention.KiviMeta``). A *source* index addresses the concatenation of the
open pages (``slot * page + offset``, ``num_slots * page`` entries) and the step's new token
rows (``num_slots * page + row``). An open page's head is stored in its pool page's value bytes
(``paged.kv.packed_cache``), so a slot's content is only whole beside its page: ``plan`` says
where each slot's head is read (``slot_page``) and written back (``slot_write``).

Host-only: numpy, no JAX.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from paged.kv.paging import NULL_PAGE

#: A page index past any pool: a write there is dropped.
NO_PAGE = 2**30


def close_rows(t_pad: int, s_pad: int, page_size: int) -> int:
    """Pages a step of ``t_pad`` token rows and ``s_pad`` sequences may close at most (a static
    shape): each sequence closes ``q // page + 1`` pages at most."""
    return t_pad // page_size + min(s_pad, t_pad)


class OpenPages:
    """Slots of the open-page buffer, owned by physical pages (see the module docstring).

    Args:
      num_slots: slots in the device buffer (``max_num_seqs``: one open page per running
        sequence).
      page_size: tokens per page.
      in_use: ``in_use(page)``: whether a page still belongs to a sequence (the block manager's
        refcount > 0); slots of pages not in use are reclaimed when slots run short.
      version: ``version(page)``: the page's content version (the block manager's
        ``block_version``, which changes whenever the page is handed out fresh), or None. A slot
        whose page was handed out again since the slot was taken is stale although the page is
        in use (e.g. a later page of a prompt whose chunks have not reached it yet) and is
        reclaimed as well.
    """

    def __init__(self, num_slots: int, page_size: int, in_use: Callable[[int], bool],
                 version: Callable[[int], int] | None = None):
        self.num_slots = num_slots
        self.page_size = page_size
        self.in_use = in_use
        self.version = version
        self.version_of: dict[int, int] = {}  # page -> its version when its slot was taken
        self.slot_of: dict[int, int] = {}
        self.swapped: dict[int, tuple] = {}  # host slot -> (k, v) of a swapped-out open page
        self._free = list(range(num_slots - 1, -1, -1))

    def held(self, page: int) -> bool:
        """Whether ``page``'s slot holds a live open page: the page is in use and was not
        handed out again since its slot was taken."""
        return self.in_use(page) and (self.version is None
                                      or self.version(page) == self.version_of.get(page))

    @property
    def num_held(self) -> int:
        """Slots mapped to a live open page (the open pages of the sequences that hold one)."""
        return sum(1 for page in self.slot_of if self.held(page))

    def _take(self, page: int) -> int:
        if not self._free:
            for p in [p for p in self.slot_of if not self.held(p)]:
                self._free.append(self.slot_of.pop(p))
                self.version_of.pop(p, None)
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} open-page slots are held by pages in use: "
                               f"more open pages than max_num_seqs (a bug)")
        self.slot_of[page] = slot = self._free.pop()
        if self.version is not None:
            self.version_of[page] = self.version(page)
        return slot

    def _release(self, page: int) -> None:
        self.version_of.pop(page, None)
        slot = self.slot_of.pop(page, None)
        if slot is not None:
            self._free.append(slot)

    def copy(self, pairs: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """Copy-on-write ``(src, dst)`` page pairs: each ``dst`` gets a slot that must become a
        copy of ``src``'s (returned as ``(src_slot, dst_slot)`` for the device; pages without an
        open slot are skipped: a full page has none)."""
        out = []
        for src, dst in pairs:
            if src in self.slot_of:
                s = self.slot_of[src]
                self._release(dst)
                out.append((s, self._take(dst)))
        return out

    def swap_out(self, pairs: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """Swap-out ``(page, host_slot)`` pairs: the ``(slot, host_slot)`` of each page with an
        open slot, whose content the caller saves (:meth:`keep`); the page's slot is released
        unless a sequence that stays still holds the page."""
        out = []
        for page, host in pairs:
            self.swapped.pop(host, None)
            if page in self.slot_of:
                out.append((self.slot_of[page], host))
                if not self.held(page):  # else a sequence that stays still reads it
                    self._release(page)
        return out

    def keep(self, host_slots: list[int], k: np.ndarray, v: np.ndarray) -> None:
        """Holds swapped-out open pages (``k``, ``v``: ``[L, Hkv, n, page, D]``) by host slot."""
        for i, host in enumerate(host_slots):
            self.swapped[host] = (k[:, :, i], v[:, :, i])

    def swap_in(self, pairs: Iterable[tuple[int, int]]) -> tuple[list[int], list, list]:
        """Swap-in ``(host_slot, page)`` pairs: ``(slots, ks, vs)``, a fresh slot for each page
        whose host slot held an open page, and that page's content to write there."""
        slots, ks, vs = [], [], []
        for host, page in pairs:
            if host in self.swapped:
                k, v = self.swapped.pop(host)
                self._release(page)
                slots.append(self._take(page))
                ks.append(k)
                vs.append(v)
        return slots, ks, vs

    def empty(self, t_pad: int, s_pad: int) -> dict[str, np.ndarray]:
        """The index arrays of an all-padding step (nothing read, written or closed)."""
        p, c = self.page_size, close_rows(t_pad, s_pad, self.page_size)
        return dict(row_len=np.zeros(t_pad, np.int32), row_seq=np.zeros(t_pad, np.int32),
                    open_src=np.zeros((t_pad, p), np.int32),
                    open_dst=np.full(t_pad, self.num_slots * p, np.int32),
                    close_dst=np.full(c, NULL_PAGE, np.int32),
                    close_src=np.zeros((c, p), np.int32),
                    slot_page=self.slot_pages(),
                    slot_write=np.full(self.num_slots, NO_PAGE, np.int32))

    def slot_pages(self) -> np.ndarray:
        """``i32[num_slots]``: the page each slot is mapped to (``NULL_PAGE``: none), where the
        head of its open page is read from."""
        out = np.full(self.num_slots, NULL_PAGE, np.int32)
        for page, slot in self.slot_of.items():
            out[slot] = page
        return out

    def plan(self, kv_lens: np.ndarray, cu_q_lens: np.ndarray, page_indices: np.ndarray,
             num_seqs: int, t_pad: int) -> dict[str, np.ndarray]:
        """One step's index arrays (numpy), slots assigned and released:

        ``row_len i32[T]``: keys each token row attends to (its position + 1; 0: padding);
        ``row_seq i32[T]``: its sequence; ``open_src i32[T, page]``: source of each offset of the
        row's open page (offsets past ``row_len % page`` are not read); ``open_dst i32[T]``:
        where the row's new K/V goes in the open buffer (``num_slots * page``: dropped, its page
        closed in this step); ``close_dst i32[C]``: pages that fill in this step
        (``NULL_PAGE``: padding) and ``close_src i32[C, page]``: the sources of their tokens;
        ``slot_page i32[S]``: each slot's page as the step starts (its head is read there);
        ``slot_write i32[S]``: the page of each slot written in this step, whose head is stored
        back there (``NO_PAGE``: not written; a stale slot's page may belong to another sequence
        by now and is never written).
        """
        p, s_pad = self.page_size, page_indices.shape[0]
        out = self.empty(t_pad, s_pad)
        base, nc = self.num_slots * p, 0
        for i in range(num_seqs):
            new, r0 = int(kv_lens[i]), int(cu_q_lens[i])
            q = int(cu_q_lens[i + 1]) - r0
            old, table = new - q, page_indices[i]
            s_old = self.slot_of[int(table[old // p])] if old % p else -1
            if old % p and s_old < 0:
                raise RuntimeError(f"sequence row {i}: open page {table[old // p]} has no slot")

            def src(pos, s_old=s_old, old=old, r0=r0):  # pos: i64[...] in [old // p * p, new)
                return np.where(pos < old, s_old * p + pos % p, base + r0 + pos - old)

            pos = np.arange(old, new)
            rows = np.arange(r0, r0 + q)
            n = pos + 1
            out["row_len"][rows] = n
            out["row_seq"][rows] = i
            offs = (n // p * p)[:, None] + np.arange(p)[None, :]
            out["open_src"][rows] = np.where(offs < n[:, None], src(np.minimum(offs, new - 1)), 0)
            for j in range(old // p, new // p):  # pages whose last token is new here
                out["close_dst"][nc] = table[j]
                out["close_src"][nc] = src(j * p + np.arange(p))
                nc += 1
                self._release(int(table[j]))  # read above from this step's snapshot: reusable
            if new % p:
                page = int(table[new // p])
                slot = self.slot_of.get(page)  # a stale slot of a page started here: harmless
                if slot is None:
                    slot = self._take(page)
                elif self.version is not None:  # a stale slot reused: live again
                    self.version_of[page] = self.version(page)
                out["slot_write"][slot] = page
                last = pos >= new // p * p
                out["open_dst"][rows[last]] = slot * p + pos[last] % p
        return out


__all__ = ["NO_PAGE", "OpenPages", "close_rows"]
