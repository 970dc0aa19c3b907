"""KV cache events in vLLM's schema: every prefix-cache key stored or removed, for routers.

The block manager's prefix-cache indexes report each key they index or drop to a `KVEventSink`
(``BlockManager.set_event_sink``): the device index as medium ``"GPU"`` (vLLM's name for the
device pool, whatever the accelerator), the host tier's as ``"CPU"``. The sink turns them into
vLLM's events (``vllm/distributed/kv_events.py``): ``BlockStored`` (``block_hashes``,
``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``, ``medium``, ``lora_name``;
consecutive blocks of one chain coalesce into one event, as vLLM stores a request's new blocks),
``BlockRemoved`` (``block_hashes``, ``medium``) and ``AllBlocksCleared``. A block hash is the
key's digest (16 bytes of XXH3 by default: vLLM's raw-bytes form of ``ExternalBlockHash``). A
first block of a tenant's chain carries vLLM's ``extra_keys`` with the tenant's ``cache_salt``.

Wire format (`encode_batch`): vLLM's current msgpack layout, a ``KVEventBatch`` as the array
``[ts, events, data_parallel_rank]`` whose events are maps tagged by ``"type"``;
`decode_batch` also reads the legacy layout (each event an array, its tag first).

`KVCacheView` is a subscriber's picture of one replica's cache, rebuilt from the events alone:
the multiset of hashes per medium (equal to the indexes' keys after every batch) and, for
routing, the chain of (parent, block tokens) -> hash, so a prompt's cached prefix is found by
walking its blocks (no hash function or model salt needed; a tenant's chain starts at its own
root).
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Sequence

import msgpack

from paged.request.checks import TENANT_MARK

MEDIUM_DEVICE = "GPU"
MEDIUM_HOST = "CPU"


def wire_hash(digest: Hashable) -> bytes | int:
    """A key digest as an ``ExternalBlockHash`` (bytes or int; another digest type, from an
    injected ``hash_fn``, as its repr's bytes)."""
    return digest if isinstance(digest, (bytes, int)) else repr(digest).encode()


def tenant_of(salt: bytes) -> str | None:
    """The tenant's ``cache_salt`` inside a key salt (`paged.request.checks`), or None."""
    _, mark, tenant = salt.partition(TENANT_MARK)
    return tenant.decode("utf-8", "replace") if mark else None


class _MediumSink:
    """What one index calls: ``stored(key, block)`` / ``removed(digest, block)`` for one
    medium (the block is not part of an event)."""

    __slots__ = ("medium", "sink")

    def __init__(self, sink: KVEventSink, medium: str):
        self.sink, self.medium = sink, medium

    def stored(self, key, block: int | None = None) -> None:
        self.sink.stored(key, self.medium)

    def removed(self, digest, block: int | None = None) -> None:
        self.sink.removed(digest, self.medium)


class KVEventSink:
    """Collects one replica's events until ``take()`` (the publisher's per-step call)."""

    def __init__(self):
        self.events: list[dict] = []
        self.num_events = 0  # events made since construction (coalesced ones count once)

    def medium(self, name: str) -> _MediumSink:
        return _MediumSink(self, name)

    def stored(self, key, medium: str) -> None:
        h = wire_hash(key.digest)
        parent = None if key.parent is None else wire_hash(key.parent.digest)
        tokens = list(key.token_ids)
        last = self.events[-1] if self.events else None
        if (parent is not None and last is not None and last["type"] == "BlockStored"
                and last["medium"] == medium and last["block_hashes"][-1] == parent
                and last["block_size"] == len(tokens)):
            last["block_hashes"].append(h)
            last["token_ids"] += tokens
            if "extra_keys" in last:
                last["extra_keys"].append(None)
            return
        ev = {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent,
              "token_ids": tokens, "block_size": len(tokens), "lora_id": None, "medium": medium,
              "lora_name": None}
        tenant = tenant_of(key.salt) if parent is None else None
        if tenant is not None:
            ev["extra_keys"] = [[tenant]]
        self._add(ev)

    def removed(self, digest, medium: str) -> None:
        h = wire_hash(digest)
        last = self.events[-1] if self.events else None
        if last is not None and last["type"] == "BlockRemoved" and last["medium"] == medium:
            last["block_hashes"].append(h)
            return
        self._add({"type": "BlockRemoved", "block_hashes": [h], "medium": medium})

    def cleared(self) -> None:
        self._add({"type": "AllBlocksCleared"})

    def _add(self, ev: dict) -> None:
        self.events.append(ev)
        self.num_events += 1

    def take(self) -> list[dict]:
        """The events since the last call, oldest first."""
        out, self.events = self.events, []
        return out


def snapshot(index, sink: _MediumSink) -> None:
    """Reports every key ``index`` (a ``PrefixCacheIndex``) holds now as stored, parents before
    children (a sink attached to a cache that is not empty)."""
    keys = [index.key[b] for b in index.blocks()]
    depth: dict[int, int] = {}

    def depth_of(key) -> int:
        chain = []
        while key is not None and id(key) not in depth:
            chain.append(key)
            key = key.parent
        d = 0 if key is None else depth[id(key)]
        for k in reversed(chain):
            d += 1
            depth[id(k)] = d
        return d

    for key in sorted(keys, key=depth_of):
        sink.stored(key)


# --- the wire ----------------------------------------------------------------------------------
_LEGACY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name", "extra_keys"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def encode_batch(ts: float, events: list[dict], data_parallel_rank: int | None = None) -> bytes:
    """A ``KVEventBatch`` as msgpack bytes (vLLM's layout, module docstring)."""
    return msgpack.packb([ts, events, data_parallel_rank], use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[dict], int | None]:
    """``(ts, events, data_parallel_rank)`` of a ``KVEventBatch`` (either layout); each event a
    map with its ``"type"``.

    Raises:
      ValueError: not a ``KVEventBatch``.
    """
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        ts, raw_events = batch[0], batch[1]
        rank = batch[2] if len(batch) > 2 else None
        events = []
        for ev in raw_events:
            if isinstance(ev, list):  # legacy: [tag, field, ...] in declaration order
                names = _LEGACY_FIELDS[ev[0]]
                ev = {"type": ev[0], **dict(zip(names, ev[1:]))}
            events.append(ev)
    except (ValueError, TypeError, KeyError, IndexError, msgpack.UnpackException) as e:
        raise ValueError(f"not a KVEventBatch: {type(e).__name__}: {e}") from None
    return float(ts), events, rank


# --- a subscriber's view -----------------------------------------------------------------------
class KVCacheView:
    """One replica's prefix cache as its events describe it (module docstring)."""

    def __init__(self):
        self.blocks: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._child: dict[tuple, Hashable] = {}  # (medium, parent or root, tokens) -> hash
        self._where: dict[tuple, tuple] = {}  # (medium, hash) -> its (parent or root, tokens)
        self.num_events = 0
        self.block_size: int | None = None  # from the first BlockStored

    def keys(self, medium: str = MEDIUM_DEVICE) -> collections.Counter:
        """The hashes held on ``medium``, each with its number of copies."""
        return +self.blocks[medium]

    def apply(self, events: Sequence[dict]) -> None:
        for ev in events:
            self.num_events += 1
            kind = ev["type"]
            if kind == "BlockStored":
                self._stored(ev)
            elif kind == "BlockRemoved":
                for h in ev["block_hashes"]:
                    self._removed(ev.get("medium") or MEDIUM_DEVICE, h)
            elif kind == "AllBlocksCleared":
                self.clear()
            # Other event types (a newer publisher's) are skipped, as vLLM's consumers do.

    def clear(self) -> None:
        self.blocks.clear()
        self._child.clear()
        self._where.clear()

    def _stored(self, ev: dict) -> None:
        medium = ev.get("medium") or MEDIUM_DEVICE
        bs, tokens, hashes = ev["block_size"], ev["token_ids"], ev["block_hashes"]
        self.block_size = bs
        extra = ev.get("extra_keys") or []
        parent = ev["parent_block_hash"]
        if parent is None:
            tenant = extra[0][0] if extra and extra[0] else None
            parent = ("root", tenant)
        for i, h in enumerate(hashes):
            toks = tuple(tokens[i * bs:(i + 1) * bs])
            self.blocks[medium][h] += 1
            self._child[(medium, parent, toks)] = h
            self._where[(medium, h)] = (parent, toks)
            parent = h

    def _removed(self, medium: str, h) -> None:
        c = self.blocks[medium]
        c[h] -= 1
        if c[h] > 0:
            return
        del c[h]
        where = self._where.pop((medium, h), None)
        if where is not None and self._child.get((medium, *where)) == h:
            del self._child[(medium, *where)]

    def match(self, token_ids: Sequence[int], block_size: int,
              tenant: str | None = None) -> tuple[int, int]:
        """``(device, host)`` hit tokens of a prompt, as admission counts them
        (``BlockManager.tiered_prefix_tokens``): its leading full blocks held on the device, then
        the blocks after them held on the host, never the block holding the final token."""
        n = (len(token_ids) - 1) // block_size
        parent: Hashable = ("root", tenant)
        out = [0, 0]
        i = 0
        for j, medium in enumerate((MEDIUM_DEVICE, MEDIUM_HOST)):
            child = self._child
            while i < n:
                h = child.get((medium, parent, tuple(token_ids[i * block_size:
                                                               (i + 1) * block_size])))
                if h is None:
                    break
                parent, i = h, i + 1
                out[j] += block_size
        return out[0], out[1]


__all__ = ["MEDIUM_DEVICE", "MEDIUM_HOST", "KVCacheView", "KVEventSink", "decode_batch",
           "encode_batch", "snapshot", "tenant_of", "wire_hash"]
