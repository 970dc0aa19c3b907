"""The simulator's fleet capacity per KV policy (`experiments/kv_policies.py`'s ``fleet`` column).

One modelled replica (``config.fleet``: a model of `paged.sim.specs.MODELS` on the H200 roofline,
`paged.sim.roofline`) serving long fixed prompts with a few hundred output tokens; the policy is
the arm's, run by the simulator's own host core: the same ``KVPolicyRunner`` as the engine (the
policy's ``keep_count``, its call points, the blocks ``BlockManager.compact`` frees), each
compaction priced as a copy of its region's blocks (docs/kv-policies.md, *The simulator*). The
capacity is `experiments.fleet_sweep.capacity` (bracket, then bisect) at the SLO.

Which tokens a method keeps does not change the host's bookkeeping, only how many: arms whose
policy keeps the same counts (every method at one budget except PyramidKV, whose pages are its
largest layer's) share one simulation (``key``). ``evidence: simulated``.
"""

from __future__ import annotations

import dataclasses

from experiments import fleet_sweep


def key(policy) -> tuple:
    """Arms with equal keys free the same blocks at the same steps (module docstring)."""
    if policy is None or policy.method == "full":
        return ("full",)
    shared = ("*" if policy.method not in ("pyramidkv",) else policy.method,)
    fields = dataclasses.asdict(policy)
    fields.pop("method")
    if shared == ("*",):
        fields = {k: fields[k] for k in ("budget", "interval")}
    return shared + tuple(sorted(fields.items()))


def _engine(f, policy):
    from paged import EngineConfig
    from paged.sim.specs import MODELS

    model = MODELS[f.model]
    base = EngineConfig(model="sim", block_size=f.block_size,
                        max_model_len=f.prompt_len + f.output_len, max_num_seqs=f.max_num_seqs,
                        max_num_batched_tokens=f.max_num_batched_tokens, async_scheduling=False,
                        enable_prefix_caching=False,
                        kv_policy=None if policy is None or policy.method == "full" else policy)
    return fleet_sweep.engine_for(base, model, f.kv_gb), model


def _workload(f, num: int, rate: float, max_model_len: int):
    from paged.workload.workload import make_workload

    return make_workload("fixed", num, rate, max_model_len=max_model_len, seed=f.seed,
                         prompt_len=f.prompt_len, output_len=f.output_len)


def capacity(f, policy) -> dict:
    """The capacity at the SLO of one replica running ``policy`` (``f``: ``config.fleet``)."""
    from paged.sim import H200, RooflineStepModel

    cfg, model = _engine(f, policy)
    sm = RooflineStepModel(H200, model, block_size=cfg.block_size)
    cap, points = fleet_sweep.capacity(f, lambda r: fleet_sweep.run_point(f, cfg, sm, _workload,
                                                                           r))
    at = [p for p in points if p["rate"] == cap]
    s = at[0]["summary"] if at else {}
    keep = ("rate", "meets_slo")
    return {"capacity_rps": cap, "num_blocks": cfg.num_blocks,
            "output_tok_s_at_capacity": s.get("output_throughput"),
            "p99_ttft_ms_at_capacity": s.get("p99_ttft_ms"),
            "p99_tpot_ms_at_capacity": s.get("p99_tpot_ms"),
            "peak_used_blocks_at_capacity": s.get("peak_used_blocks"),
            "preemptions_at_capacity": s.get("engine_preemptions"),
            "points": [{**{k: p[k] for k in keep}, **p["summary"]} for p in points]}


__all__ = ["capacity", "key"]
