"""Prefix-cache eviction settings: the policy names, their parameters, and the one parser.

``EngineConfig.prefix_eviction`` is a string: a policy name, optionally followed by ``:`` and
``key=value`` parameters separated by commas, e.g. ``"lru"``, ``"slru:protected=0.5"``,
``"waiting:lookahead=16"``. The policies themselves live in ``paged.kv.blocks.eviction`` (one file
each); this module only checks a setting, so a bad one fails when the config is built.
"""

from __future__ import annotations

# name -> {parameter: (default, minimum, maximum)}; every parameter is a number.
EVICTION_POLICIES: dict[str, dict[str, tuple[float, float, float]]] = {
    "lru": {},  # least recently released first (the default; tail blocks of a chain first)
    "lfu": {},  # fewest hits since the block got its content first, LRU among equals
    "slru": {"protected": (0.8, 0.0, 1.0)},  # protected segment: this fraction of the pool
    "priority": {"default": (35, 0, 100)},  # per-request priority (0..100) and retention time
    "cost": {"alpha": (2.0, 0.0, 4.0)},  # hits x (prefix tokens) ** alpha (vllm#23641)
    "waiting": {"lookahead": (8, 1, 1024)},  # protects what the first N waiting requests hit
    "tail_first": {},  # LRU, but never a block whose child in the chain is cached
    "arc": {},  # ARC: recency and frequency lists with ghosts of evicted digests, self-tuning
}
INT_PARAMS = {"lookahead", "default"}


def parse_eviction(spec) -> tuple[str, dict[str, float]]:
    """``(name, params)`` of an eviction setting, every parameter present (defaults filled in).

    Raises:
      TypeError: ``spec`` is not a str.
      ValueError: an unknown name or parameter, a malformed or out-of-range value (one line).
    """
    if not isinstance(spec, str):
        raise TypeError(f"prefix_eviction={spec!r:.80} must be a str such as 'lru' or "
                        f"'slru:protected=0.5'")
    name, sep, rest = spec.partition(":")
    if name not in EVICTION_POLICIES:
        raise ValueError(f"prefix_eviction={spec!r}: unknown policy {name!r}; known: "
                         f"{', '.join(EVICTION_POLICIES)}")
    if sep and not rest.strip():
        raise ValueError(f"prefix_eviction={spec!r}: empty parameter list after ':'")
    schema = EVICTION_POLICIES[name]
    params = {k: v[0] for k, v in schema.items()}
    for item in filter(None, rest.split(",")) if rest else ():
        key, eq, value = item.partition("=")
        key = key.strip()
        if key not in schema or not eq:
            known = ", ".join(schema) or "none"
            raise ValueError(f"prefix_eviction={spec!r}: bad parameter {item!r} for {name!r} "
                             f"(parameters: {known}; write key=value)")
        try:
            x = int(value) if key in INT_PARAMS else float(value)
        except ValueError:
            raise ValueError(f"prefix_eviction={spec!r}: {key}={value!r} is not "
                             f"{'an int' if key in INT_PARAMS else 'a number'}") from None
        lo, hi = schema[key][1], schema[key][2]
        if not lo <= x <= hi:
            raise ValueError(f"prefix_eviction={spec!r}: {key}={x} must be in [{lo}, {hi}]")
        params[key] = x
    return name, params
