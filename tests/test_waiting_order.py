"""Cache-aware waiting orders (`paged.step.waiting_order`): "lpm" and "dfs-weight" on hand-built
queues, the starvation guard under an adversarial arrival order (in the simulator, unchanged),
and one clear error for bad names and parameters."""

from __future__ import annotations

import collections
import types

import pytest
from test_sim_kv_whatifs import TINY, Recorder

from paged import EngineConfig
from paged.kv.block_manager import BlockManager
from paged.sim import Simulator
from paged.step.waiting_order import SCAN_LIMIT, WaitingOrder, dfs_weight_order
from paged.workload.workload import RequestSpec, Workload

B = 4


def _cache(bm: BlockManager, *prompts) -> None:
    """Computes and frees each prompt, so its full blocks stay cached."""
    for i, p in enumerate(prompts):
        sid = f"warm{i}"
        bm.allocate(sid, p)
        bm.mark_computed(sid, len(p))
        bm.free(sid)


def _seq(sid, tokens, arrival=0.0, preempted=0):
    return types.SimpleNamespace(seq_id=sid, token_ids=list(tokens), cache_salt=None,
                                 arrival_time=arrival, num_preemptions=preempted)


def test_dfs_weight_order_by_hand():
    # Tree: x (a, b, d pass through it) -> y (a, d); z (c); root (e). Heaviest branch first,
    # a node's children before its own requests, root's own last.
    chains = [("a", ["x", "y"]), ("b", ["x"]), ("c", ["z"]), ("d", ["x", "y"]), ("e", [])]
    assert dfs_weight_order(chains) == ["a", "d", "b", "c", "e"]
    # Ties between siblings keep first-seen order; deep chains need no recursion.
    assert dfs_weight_order([("p", ["q"]), ("r", ["s"])]) == ["p", "r"]
    deep = [("deep", list(range(5000))), ("shallow", [0])]
    assert dfs_weight_order(deep) == ["deep", "shallow"]


def test_lpm_and_dfs_weight_order_a_hand_built_queue():
    bm = BlockManager(64, B)
    base = list(range(1, 17))  # 4 blocks
    other = list(range(100, 117))
    _cache(bm, base + [0], other + [0])
    s_none = _seq(0, range(200, 213), arrival=0.0)       # hits nothing
    s_one = _seq(1, base[:4] + [7] * 9, arrival=1.0)       # 1 block of base
    s_three = _seq(2, base[:12] + [9] * 5, arrival=2.0)    # 3 blocks of base
    s_other = _seq(3, other + [5], arrival=3.0)            # 4 blocks of other
    s_three2 = _seq(4, base[:12] + [8] * 5, arrival=4.0)   # 3 blocks of base again
    queue = [s_none, s_one, s_three, s_other, s_three2]

    q = collections.deque(queue)
    WaitingOrder("lpm", bm, B, max_wait_s=100.0).apply(q, now=5.0)
    assert [s.seq_id for s in q] == [3, 2, 4, 1, 0]  # longest hit first, ties by arrival

    q = collections.deque(queue)
    WaitingOrder("dfs-weight", bm, B, max_wait_s=100.0).apply(q, now=5.0)
    # base's branch holds three requests (weight 3) against other's one: the two 3-block hits,
    # then the 1-block hit at their ancestor, then other's, then the cold one at the root.
    assert [s.seq_id for s in q] == [2, 4, 1, 3, 0]


def test_guard_puts_preempted_and_starved_first_oldest_first():
    bm = BlockManager(64, B)
    base = list(range(1, 17))
    _cache(bm, base + [0])
    hot = [_seq(i, base + [i], arrival=10.0 + i) for i in range(3)]
    cold_old = _seq(10, range(300, 313), arrival=0.0)
    cold_older = _seq(11, range(400, 413), arrival=-1.0)
    back = _seq(12, range(500, 513), arrival=9.5, preempted=1)
    q = collections.deque([*hot, cold_old, cold_older, back])
    order = WaitingOrder("lpm", bm, B, max_wait_s=5.0)
    order.apply(q, now=12.5)
    assert [s.seq_id for s in q] == [12, 11, 10, 0, 1, 2]
    order.note_admitted(cold_older, 12.5)
    order.note_admitted(hot[0], 12.5)
    assert order.num_starved == 1


def test_only_the_scan_window_is_reordered():
    bm = BlockManager(64, B)
    base = list(range(1, 17))
    _cache(bm, base + [0])
    cold = [_seq(i, [300 + i] * 13, arrival=float(i)) for i in range(SCAN_LIMIT + 2)]
    hot = _seq(999, base + [1], arrival=1e3)  # arrives last: outside the window
    q = collections.deque([*cold, hot])
    WaitingOrder("lpm", bm, B, max_wait_s=1e6).apply(q, now=1e3)
    assert [s.seq_id for s in q] == [s.seq_id for s in cold] + [999]


def _adversarial() -> Workload:
    """One cold request at t=1 ms among a stream of requests sharing a 3-block prefix, arriving
    faster than one sequence at a time can serve them (the queue never drains)."""
    shared = list(range(1, 25))
    reqs = [RequestSpec(f"hot{i}", i * 0.002, tuple(shared + [100 + i] * 8), None, 32, 4)
            for i in range(60)]
    reqs.append(RequestSpec("cold", 0.001, tuple(range(200, 232)), None, 32, 4))
    return Workload("adversarial", tuple(sorted(reqs, key=lambda r: r.arrival_s)),
                    "constructed", 0, {})


def _cold_wait(policy: str, max_wait_s: float = 10.0) -> float:
    cfg = EngineConfig(block_size=8, num_blocks=64, max_model_len=64, max_num_seqs=1,
                       max_num_batched_tokens=64, async_scheduling=False, policy=policy,
                       policy_max_wait_s=max_wait_s)
    res = Simulator(cfg, Recorder(), model_config=TINY, build_device=False).run(_adversarial())
    rec = {r.request_id: r for r in res.records}
    assert all(r.status == "finished" for r in res.records)
    return rec["cold"].first_scheduled_s - rec["cold"].arrival_s


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_starvation_bound_holds_under_adversarial_arrivals(policy):
    # Without the guard the cold request waits for the whole stream (~ 60 requests x 5 steps);
    # with it, at most the bound plus the request running when it starves (5 steps of 1 ms).
    assert _cold_wait(policy, float("inf")) > 0.2
    bound = 0.03
    assert _cold_wait(policy, bound) <= bound + 0.006
    assert _cold_wait("decode-first") <= 0.006  # FCFS: second in line


def test_bad_policy_name_and_parameter_are_one_clear_error():
    with pytest.raises(ValueError, match="policy='lmp' must be one of"):
        EngineConfig(policy="lmp")
    with pytest.raises(ValueError, match="policy_max_wait_s"):
        EngineConfig(policy="lpm", policy_max_wait_s=-1.0)
    with pytest.raises(TypeError, match="policy_max_wait_s"):
        EngineConfig(policy="lpm", policy_max_wait_s="5")
    with pytest.raises(ValueError, match="refused pair: cache_aware_scheduling"):
        EngineConfig(policy="dfs-weight", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="not a cache-aware order"):
        WaitingOrder("fcfs", None, B, 1.0)
