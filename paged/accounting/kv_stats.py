"""``Engine.kv_stats()``: pool occupancy, prefix-cache and preemption counters, memory ledger."""

from __future__ import annotations

from paged import accounting


def kv_stats(engine, held_for_transfer=()) -> dict:
    """The engine's KV figures now (see ``Engine.kv_stats``). ``held_for_transfer``: sequence
    ids whose blocks a hand-over still holds besides the parked ones (``paged.fleet.handover``)."""
    bm, config = engine.block_manager, engine.config
    stats = bm.stats()
    held = [*engine.core.parked_seq_ids(), *held_for_transfer]
    # A block holds one pool page's layers (``KVSpec.page``): all of them, or one group's share.
    ledger = accounting.MemoryLedger.from_blocks(
        engine.kv_spec.page, engine.page_size, engine.cache.num_pages, used=bm.block_usage(excluding=held),
        transfer=bm.num_blocks_only_in(held),
        cached_free=bm.num_cached_blocks, free=bm.num_free_blocks,
        reserved=bm.num_quarantined_blocks,
        block_table_bytes=accounting.block_table_bytes(config.max_num_seqs, engine.pages_per_seq),
        workspace_bytes=workspace_bytes(engine.model_config, config),
        staged_positions=0 if engine.speculator is None else engine.speculator.num_staged,
        open_page_bytes=engine.cache.open_nbytes,
        open_pages_held=0 if engine.open_pages is None
        else engine.open_pages.num_held)
    sched = engine.scheduler
    ledger = ledger.as_dict()
    # A flow beside the pool's categories (which are a snapshot and still sum to the pool): the
    # bytes of blocks that left a sliding window and went back to the pool since the start.
    ledger["recycled_bytes"] = stats["recycled_blocks"] * ledger["bytes_per_block"]
    # Likewise the blocks a KV policy's compactions freed (docs/kv-policies.md).
    runner = engine.core.kv_runner
    policy = None if runner is None else runner.stats()
    ledger["evicted_bytes"] = 0 if runner is None else runner.pages_freed * ledger["bytes_per_block"]
    tier = host_tier_stats(bm.host_tier_stats(), ledger["bytes_per_block"], sched)
    ledger["host_tier"] = tier.pop("ledger")
    return {
        "kv_layout": config.kv_layout,
        "block_size": engine.page_size,
        "num_blocks": engine.cache.num_pages,
        "num_free_blocks": bm.num_free_blocks,
        "num_cached_blocks": bm.num_cached_blocks,
        "num_quarantined_blocks": bm.num_quarantined_blocks,
        "num_used_blocks": bm.num_used_blocks,
        # Slots holding speculative tokens not verified yet (0 whenever no step is in flight).
        "num_staged_tokens": 0 if engine.speculator is None else engine.speculator.num_staged,
        "prefix_cache_hit_tokens": stats.get("hit_tokens", 0),
        "num_preemptions": sched.num_preemptions,
        "num_swap_outs": sched.num_swap_outs,
        "num_running": len(sched.running),
        "num_waiting": len(sched.waiting),
        "num_swapped": len(sched.swapped),
        "num_requests_served": engine.num_requests_served,
        # Tokens scheduled in prompt chunks, decode rows and recompute chunks (HostCore).
        "num_prefill_tokens": engine.core.num_prefill_tokens,
        "num_decode_tokens": engine.core.num_decode_tokens,
        "num_recompute_tokens": engine.core.num_recompute_tokens,
        # The most blocks one sequence held at once since the start (with a sliding window at
        # most ceil(W / block_size) + 1 once its prompt is behind it), and the blocks freed
        # because they left the window.
        "max_blocks_per_sequence": stats["max_blocks_per_sequence"],
        "recycled_blocks": stats["recycled_blocks"],
        "block_manager": stats,
        # Shared-prefix attention: mode, decode steps that used it, groups served and prefix
        # token reads saved per layer and KV head (paged.step.cascade_plan.CascadePlanner.stats).
        "cascade": engine.builder.cascade.stats(),
        "ledger": ledger,
        "host_tier": tier,
        # Block lifetime, idle time before eviction, reuse gap and distance, eviction regret
        # and token hit rate, per tier (paged.kv.blocks.residency).
        "residency": bm.residency_stats(),
        # The KV policy's calls, tokens dropped (per layer and KV head) and pages freed; None
        # without one.
        "kv_policy": policy,
    }


def host_tier_stats(counters: dict, bytes_per_block: int, sched) -> dict:
    """``kv_stats()["host_tier"]`` from ``BlockManager.host_tier_stats()`` (all zero without a
    tier), with its byte split under ``"ledger"``: cached, loading (read by a load in flight),
    offloading (written by an offload in flight) and free slots, summing to ``bytes``."""
    c = {k: counters.get(k, 0) for k in (
        "num_blocks", "free", "cached", "writing", "held", "hits", "hit_tokens",
        "offloaded_blocks", "loaded_blocks", "deduplicated_blocks", "dropped_blocks",
        "evicted_blocks")}
    used = c["cached"] + c["writing"] + c["held"]
    return {
        "num_blocks": c["num_blocks"],
        "used_blocks": used,
        "bytes": c["num_blocks"] * bytes_per_block,
        "used_bytes": used * bytes_per_block,
        "hits": c["hits"],
        "hit_tokens": c["hit_tokens"],
        "offloaded_blocks": c["offloaded_blocks"],
        "loaded_blocks": c["loaded_blocks"],
        "offloaded_bytes": c["offloaded_blocks"] * bytes_per_block,
        "loaded_bytes": c["loaded_blocks"] * bytes_per_block,
        # Evictions whose key the tier held already (no copy), evictions it could not take
        # (every slot in flight), and its own LRU evictions.
        "deduplicated_blocks": c["deduplicated_blocks"],
        "dropped_blocks": c["dropped_blocks"],
        "evicted_blocks": c["evicted_blocks"],
        "num_loading": len(sched.loading),
        "num_loads": sched.num_loads,
        "load_wait_s": sched.load_wait_s,
        "ledger": {"cached": c["cached"] * bytes_per_block,
                   "loading": c["held"] * bytes_per_block,
                   "offloading": c["writing"] * bytes_per_block,
                   "free": c["free"] * bytes_per_block},
    }


def workspace_bytes(model_config, config) -> int:
    """Estimate of the step's largest activations (f32): residual + MLP + logits rows."""
    c, t = model_config, config.max_num_batched_tokens
    return 4 * t * (3 * c.d_model + 2 * c.ffn_dim + c.num_heads * c.head_dim) + \
        4 * config.max_num_seqs * c.vocab_size
