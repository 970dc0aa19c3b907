"""What the HTTP router knows about each backend: routed prefixes, in-flight requests, load.

The router never sees a backend's prefix cache. Like SGLang's cache-aware router it keeps an
approximate picture instead: every prompt it routes is inserted into the chosen backend's
`PrefixTree` (a character-level radix tree with an LRU bound on the characters it holds), and a
new prompt's hit on a backend is the longest prefix of it that tree holds. The picture is wrong
when the backend evicted those blocks, when other clients reach the backend directly, or after
the backend restarts; it only steers, outputs never depend on it.

Load comes from two sources: the requests this router has open on the backend (``in_flight``,
exact for this router's traffic and updated at once) and the backend's own gauges
``paged:num_requests_waiting`` / ``paged:num_requests_running`` scraped from its ``/metrics``
every few seconds (every client's traffic, but stale). A backend's load is the larger of the two.

With KV events (``--kv_events``: each backend's ``python -m paged.server --kv_events`` endpoint)
the router sees the true caches instead: a `paged.router.kv_subscriber.KVEventSubscriber` per
backend keeps its `paged.kv.events.KVCacheView`, and a request's hit on a backend is the prompt's
cached prefix in that view (device tokens plus `paged.fleet.routing.HOST_TIER_WEIGHT` times the
host tier's, as in process), found by walking the prompt's token ids (`token_key`: token-id
prompts as given, text completions through the router's tokenizer; chat and text without a
tokenizer route as cold). A view whose stream lost batches counts no hits until it is reset.

`Backend` has the `paged.fleet.routing.Replica` members (``num_waiting``, ``num_running``,
``cached_prefix_tokens``), so `paged.fleet.routing.Router` makes the decision here exactly as it does
in-process over engines and in the simulator.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence

from paged.fleet.routing import HOST_TIER_WEIGHT

# The first token-id character: token ids map to code points above the Basic Multilingual Plane
# (one character per token), after a marker so that a token-id prompt never shares a prefix with
# a text prompt.
_ID_BASE = 0x10000
_ID_MARK = "\x01"
_SALT_MARK = "\x02"


def prompt_key(body: dict, endpoint: str) -> str:
    """The routing key of a request body: the text whose prefixes the trees hold.

    Completions: the prompt (the first one of a list); a token-id prompt becomes one character per
    id. Chat: each message as ``<|role|>\\ncontent\\n`` (text parts of a content list joined), the
    server's plain template; only prefix consistency matters, not the backend's exact rendering.
    A string ``cache_salt`` in the body starts the key, so that differently salted requests share
    nothing. Anything unexpected gives ``""`` (no prefix: routed as cold).
    """
    key = ""
    if endpoint == "chat":
        msgs = body.get("messages")
        if isinstance(msgs, list):
            parts = []
            for m in msgs:
                if not isinstance(m, dict):
                    break
                content = m.get("content")
                if isinstance(content, list):
                    content = "".join(p.get("text", "") for p in content
                                      if isinstance(p, dict) and p.get("type") == "text"
                                      and isinstance(p.get("text"), str))
                text = content if isinstance(content, str) else ""
                parts.append(f"<|{m.get('role')}|>\n{text}\n")
            key = "".join(parts)
    else:
        p = body.get("prompt")
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            key = p
        elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                         and 0 <= t < 0x10FFFF - _ID_BASE for t in p):
            key = _ID_MARK + "".join(chr(_ID_BASE + t) for t in p)
    salt = body.get("cache_salt")
    if isinstance(salt, str) and salt and key:
        key = f"{_SALT_MARK}{salt}{_SALT_MARK}{key}"
    return key


def token_key(body: dict, endpoint: str, tokenizer=None) -> tuple[list[int], str | None] | None:
    """``(token ids, tenant)`` of a request body for routing on KV events, or None (routed as
    cold): a completion's token-id prompt (the first of a list) as given, a text one through
    ``tokenizer.encode`` (as the server encodes it) when there is a tokenizer; the tenant is a
    string ``cache_salt``."""
    if endpoint != "completion":
        return None
    p = body.get("prompt")
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        p = p[0]
    ids = None
    if isinstance(p, str) and p and tokenizer is not None:
        try:
            ids = list(tokenizer.encode(p))
        except (TypeError, ValueError):
            return None
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                           for t in p):
        ids = p
    if not ids:
        return None
    salt = body.get("cache_salt")
    return ids, salt if isinstance(salt, str) and salt else None


# --- the approximate prefix tree ---------------------------------------------------------------
class _Node:
    __slots__ = ("children", "edge", "last", "parent")

    def __init__(self, edge: str, parent: _Node | None):
        self.edge, self.parent = edge, parent
        self.children: dict[str, _Node] = {}
        self.last = 0


def _common_len(edge: str, key: str, pos: int) -> int:
    """Length of the common prefix of ``edge`` and ``key[pos:]`` (startswith, binary search)."""
    lo, hi = 0, min(len(edge), len(key) - pos)
    if key.startswith(edge[:hi], pos):
        return hi
    hi -= 1
    while lo < hi:  # the answer is in [lo, hi]
        mid = (lo + hi + 1) // 2
        if key.startswith(edge[:mid], pos):
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixTree:
    """A radix tree of the prompts routed to one backend, bounded to ``max_chars`` characters.

    ``insert`` marks every node on the prompt's path as used now; when the tree holds more than
    ``max_chars`` characters the least recently used leaves are dropped until it holds at most
    90% of that (a leaf whose parent is left childless makes the parent a leaf in turn).
    """

    def __init__(self, max_chars: int = 1 << 22):
        if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 1:
            raise ValueError(f"max_chars={max_chars!r} must be an int >= 1")
        self.max_chars = max_chars
        self.root = _Node("", None)
        self.num_chars = 0
        self._clock = 0

    def match(self, key: str) -> int:
        """Characters of the longest prefix of ``key`` the tree holds (no side effects)."""
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common_len(child.edge, key, pos)
            pos += n
            if n < len(child.edge):
                break
            node = child
        return pos

    def insert(self, key: str) -> None:
        """Adds ``key`` (its path becomes the most recently used) and evicts past the bound."""
        self._clock += 1
        now = self._clock
        node, pos = self.root, 0
        node.last = now
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = _Node(key[pos:], node)
                leaf.last = now
                node.children[key[pos]] = leaf
                self.num_chars += len(key) - pos
                break
            n = _common_len(child.edge, key, pos)
            if n < len(child.edge):  # split the edge at n
                mid = _Node(child.edge[:n], node)
                node.children[key[pos]] = mid
                child.edge = child.edge[n:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                mid.last = child.last
                child = mid
            child.last = now
            node, pos = child, pos + n
        if self.num_chars > self.max_chars:
            self._evict(int(self.max_chars * 0.9))

    def _leaves(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out

    def _evict(self, target: int) -> None:
        while self.num_chars > target:
            leaves = sorted(self._leaves(), key=lambda n: n.last)
            if not leaves:
                break
            for leaf in leaves:
                if self.num_chars <= target:
                    break
                parent = leaf.parent
                del parent.children[leaf.edge[0]]
                self.num_chars -= len(leaf.edge)

    def __len__(self) -> int:
        return self.num_chars


# --- a backend -------------------------------------------------------------------------------
_GAUGE = re.compile(r"^(?:paged|vllm):num_requests_(waiting|running)(?:\{[^}]*\})? (\S+)$", re.M)


def parse_load(metrics_text: str) -> tuple[int, int] | None:
    """``(waiting, running)`` from a ``paged.server``'s ``/metrics`` text (``paged:`` or, with
    ``--metrics_prefix vllm``, ``vllm:`` names; vLLM's own servers too); None if absent."""
    found = {m.group(1): m.group(2) for m in _GAUGE.finditer(metrics_text)}
    try:
        return int(float(found["waiting"])), int(float(found["running"]))
    except (KeyError, ValueError):
        return None


class Backend:
    """One ``paged.server`` behind the router: its URL, health, load and routed prefixes.

    Attributes:
      url: base URL, no trailing slash (``http://host:port``).
      up: False after a connection to it failed; the next successful scrape sets it again.
      in_flight: requests this router forwarded to it that have not finished (streams included
        until their last byte is relayed).
      scraped_waiting, scraped_running: the backend's gauges at the last scrape (0 before one,
        and 0 again once it is down).
      scraped_at: ``time.monotonic()`` of the last successful scrape (None: never).
      down_since: ``time.monotonic()`` when it was marked down (None while up).
      last_error: the last connection error, for ``/health`` and logs.
      prefix_granularity: a hit is reported in whole multiples of this many characters (a real
        prefix cache holds whole blocks only, so a few shared characters are no hit).
    """

    def __init__(self, url: str, *, max_tree_chars: int = 1 << 22, prefix_granularity: int = 16,
                 kv_events: str | None = None):
        if prefix_granularity < 1:
            raise ValueError(f"prefix_granularity={prefix_granularity!r} must be >= 1")
        self.url = url.rstrip("/")
        self.events = None  # a KVEventSubscriber on the backend's KV events, or None
        if kv_events is not None:
            from paged.router.kv_subscriber import KVEventSubscriber, replay_endpoint

            self.events = KVEventSubscriber(kv_events, replay_endpoint(kv_events))
        self.tree = PrefixTree(max_tree_chars)
        self.prefix_granularity = prefix_granularity
        self.up = True
        self.in_flight = 0
        self.scraped_waiting = self.scraped_running = 0
        self.scraped_at: float | None = None
        self.down_since: float | None = None
        self.last_error: str | None = None
        self.num_requests = 0
        self.num_errors = 0

    # --- the Replica protocol (paged.fleet.routing) -----------------------------------------------
    @property
    def load(self) -> int:
        """The larger of this router's open requests and the backend's scraped waiting + running."""
        return max(self.in_flight, self.scraped_waiting + self.scraped_running)

    @property
    def num_waiting(self) -> int:
        return min(self.scraped_waiting, self.load)

    @property
    def num_running(self) -> int:
        return self.load - self.num_waiting

    def cached_prefix_tokens(self, token_ids: Sequence, cache_salt: bytes | None = None,
                             probe=None) -> int:
        """The approximate hit of routing key ``token_ids`` (a `prompt_key` string): characters of
        its longest prefix routed here before, rounded down to ``prefix_granularity``. The salt
        is part of the key already; ``probe`` (digests of a real cache) does not apply.

        With KV events: ``token_ids`` are a prompt's token ids (`token_key`) and ``cache_salt``
        its tenant; the hit is read from the backend's true cache (module docstring)."""
        if self.events is not None:
            return self.event_hit(token_ids, cache_salt)
        if not isinstance(token_ids, str) or not token_ids:
            return 0
        g = self.prefix_granularity
        return self.tree.match(token_ids) // g * g

    def event_hit(self, token_ids, tenant: str | None = None) -> int:
        """The prompt's hit tokens in the backend's KV-event view (0 while it lost batches)."""
        if not isinstance(token_ids, list) or not token_ids:
            return 0
        self.events.poll(0)
        view = self.events.view
        if self.events.stream.lost or view.block_size is None:
            return 0
        device, host = view.match(token_ids, view.block_size, tenant)
        return device + int(host * HOST_TIER_WEIGHT)

    # --- bookkeeping ----------------------------------------------------------------------------
    def routed(self, key: str) -> None:
        """A request with routing key ``key`` is being forwarded here."""
        self.in_flight += 1
        self.num_requests += 1
        if key:
            self.tree.insert(key)

    def finished(self) -> None:
        self.in_flight = max(self.in_flight - 1, 0)

    def failed(self, error: str) -> None:
        """A connection to the backend failed: it takes no requests until a scrape succeeds, and
        its prefix tree starts over (a server that went away comes back with an empty cache)."""
        self.up = False
        self.tree = PrefixTree(self.tree.max_chars)
        if self.events is not None:
            self.events.stream.reset()
        # Its last scraped gauges describe a server that is gone: a down backend reports none.
        self.scraped_waiting = self.scraped_running = 0
        self.down_since = time.monotonic()
        self.num_errors += 1
        self.last_error = error

    def scraped(self, load: tuple[int, int] | None) -> None:
        self.up, self.last_error, self.down_since = True, None, None
        if load is not None:
            self.scraped_waiting, self.scraped_running = load
        self.scraped_at = time.monotonic()

    def state(self) -> dict:
        """``/health``'s entry: ``waiting`` / ``running`` as last scraped (0 while down) with
        ``scraped_age_s``, how old that scrape is (None: never scraped), and ``down_for_s``
        (None while up)."""
        now = time.monotonic()
        age = lambda t: None if t is None else round(now - t, 3)
        return {"url": self.url, "up": self.up, "in_flight": self.in_flight,
                "waiting": self.scraped_waiting, "running": self.scraped_running,
                "scraped_age_s": age(self.scraped_at), "down_for_s": age(self.down_since),
                "tree_chars": self.tree.num_chars, "requests": self.num_requests,
                "kv_event_blocks": 0 if self.events is None else
                sum(self.events.view.keys().values()),
                "kv_events_lost": self.events is not None and self.events.stream.lost,
                "errors": self.num_errors, "last_error": self.last_error}


__all__ = ["Backend", "PrefixTree", "parse_load", "prompt_key", "token_key"]
