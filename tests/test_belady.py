"""Belady's MIN (`paged.kv.blocks.belady`): the textbook example, optimality against LRU on
random sequences, the prefix count, and the recorder seam of the block manager."""

import random
from collections import OrderedDict

import pytest

from paged.kv.block_manager import BlockManager
from paged.kv.blocks.belady import belady

# Silberschatz et al., Operating System Concepts, the optimal page-replacement example:
# 20 references, 3 frames, 9 page faults.
TEXTBOOK = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]


def test_textbook_example_nine_faults():
    r = belady([[k] for k in TEXTBOOK], 3, bypass=False)
    assert r["accesses"] - r["block_hits"] == 9
    assert belady([[k] for k in TEXTBOOK], 3)["block_hits"] >= 11  # bypass never hits less


def _lru_hits(seq, capacity):
    cache, hits = OrderedDict(), 0
    for k in seq:
        if k in cache:
            hits += 1
            cache.move_to_end(k)
        else:
            cache[k] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def _brute_force_best(seq, capacity):
    """Every eviction choice (small cases): the true optimum with demand admission."""
    best = 0

    def go(i, cache, hits):
        nonlocal best
        if i == len(seq):
            best = max(best, hits)
            return
        k = seq[i]
        if k in cache:
            go(i + 1, cache, hits + 1)
        elif len(cache) < capacity:
            go(i + 1, cache | {k}, hits)
        else:
            for v in cache:
                go(i + 1, (cache - {v}) | {k}, hits)

    go(0, frozenset(), 0)
    return best


def test_min_is_optimal_on_small_random_sequences():
    rng = random.Random(0)
    for _ in range(30):
        seq = [rng.randrange(5) for _ in range(10)]
        cap = rng.randrange(1, 4)
        r = belady([[k] for k in seq], cap, bypass=False)
        assert r["block_hits"] == _brute_force_best(seq, cap) >= _lru_hits(seq, cap)
        assert belady([[k] for k in seq], cap)["block_hits"] >= r["block_hits"]


def test_prefix_hits_stop_at_the_first_miss():
    r = belady([["a", "b", "c"], ["a", "x", "c"]], 10)
    assert (r["block_hits"], r["prefix_hits"]) == (2, 1)
    with pytest.raises(ValueError, match="capacity"):
        belady([["a"]], 0)


def test_block_manager_records_every_admission():
    bm = BlockManager(20, 2)
    log = []
    bm.record_accesses(lambda digests, hits: log.append((digests, hits)))
    bm.allocate("a", [1, 2, 3, 4, 5])
    bm.mark_computed("a", 5)
    bm.free("a")
    bm.allocate("b", [1, 2, 3, 4, 9, 9])
    assert [len(d) for d, _ in log] == [2, 2] and [h for _, h in log] == [0, 2]
    assert log[0][0] == log[1][0]  # same prefix, same digests
    bm.record_accesses(None)
    bm.allocate("c", [1, 2, 3])
    assert len(log) == 2


def test_cache_policies_study_smoke(tmp_path):
    """The study's smoke variant: every arm reports a hit rate no better than Belady's, on the
    real (derived) Mooncake window, and a bad policy is refused by its check."""
    import json

    from experiments import cache_policies
    from experiments.configs import cache_policies as config

    c = config.get_config("smoke")
    c.output_dir = str(tmp_path)
    cache_policies.main(c, cache_policies.check(c))
    payload = json.loads((tmp_path / "cache_policies.json").read_text())
    assert payload["evidence"] == "simulated"
    assert payload["traces"]["conversation"]["evidence"] == "real"
    for r in payload["rows"]:
        assert 0 < r["hit_rate"] <= r["belady_block"] and r["completed"] == r["num_requests"]
        assert r["belady_prefix"] <= r["belady_block"]
    assert "| conversation |" in (tmp_path / "cache_policies.md").read_text()
    c.policies = ("lru", "fifo")
    with pytest.raises(ValueError, match="unknown policy 'fifo'"):
        cache_policies.check(c)
