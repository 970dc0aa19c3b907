"""The parts behind `paged.kv.block_manager.BlockManager`, one job each.

* ``pool``: refcount, state and content version of every block; the free queue and the LRU of
  cached refcount-0 blocks.
* ``fence``: step ids, copy holds and the quarantine of freed blocks and host slots.
* ``prefix_index``: prefix-cache keys, the digest index (full-key verification, content versions)
  and the keyer, the one place that digests blocks.
* ``tables``: per-sequence block tables: the one decode-append path, copy-on-write, lookahead and
  rollback, fork, free.
* ``progress``: computed counts and late token ids (``mark_computed``, ``set_tokens``).
* ``admission``: ``can_allocate``/``allocate``, hashing a prompt once.
* ``swap``: swap-out and swap-in.
* ``invariants``: the whole-state check.
* ``queries``: the read-only half of the manager's interface (counts, views, stats, prefix probes).
* ``offload``: the manager's swap and host-tier calls (``host_tier``: the tier itself).
* ``shared``: the parts several KV-cache groups of one pool share.
"""
