"""The CPU engine and the simulator on the same time-scaled window of a Mooncake trace: do their
prefix-cache hit rates agree (the goal: within 1 percentage point)?

Evidence: ``measured`` (the engine, ``random-small`` on the CPU) beside ``simulated`` (the same
``EngineConfig`` in ``paged.sim``), over a ``real`` workload: a window of a Mooncake trace with
prompts shrunk to ``block`` tokens per trace block (`paged.workload.mooncake_trace`, a recorded
derivation) and arrivals compressed by ``time_scale``. Per eviction policy, three runs:

* ``engine``: the real engine on a clock that advances by each step's measured wall time
  (arrivals are admitted against it; an idle engine jumps to the next arrival), so CPU noise
  changes the timing but never lets the host run ahead of the device;
* ``sim_replay``: the simulator fed the engine's measured step times in order
  (``ReplayStepModel``): the same host code on the same clock, so any gap is a difference in the
  host code the two run;
* ``sim_fitted``: the simulator with a linear step model fitted to those times
  (``paged.sim.fit_linear`` over the shapes the simulator saw): the simulator as a study uses it,
  with its own timing, so the gap includes what the timing changes (batching, which prefixes
  are cached when a request is admitted).

Hit rates: ``token`` = prompt tokens served by the prefix cache / prompt tokens;
``block`` = prompt blocks served / prompt blocks looked up (`BlockManager.record_accesses`).
Writes ``cache_agreement.json`` and ``cache_agreement.md``.
"""

from __future__ import annotations

import dataclasses
import os
import time

from experiments import common
from paged import Engine
from paged.config.eviction import parse_eviction
from paged.sim import ReplayStepModel, Simulator, StepTimeModel, fit_linear
from paged.workload import mooncake_trace
from paged.workload.engine_replay import replay_arrivals

STUDY = "cache_agreement"


def check(c) -> dict:
    for p in c.policies:
        parse_eviction(p)
    if not c.policies or len(set(c.policies)) != len(c.policies):
        raise ValueError(f"policies={tuple(c.policies)!r} must be distinct and not empty")
    if c.trace not in mooncake_trace.TRACES:
        raise ValueError(f"trace={c.trace!r}; known: {tuple(mooncake_trace.TRACES)}")
    common.check_positive(time_scale=c.time_scale, pool_fraction=c.pool_fraction)
    base = common.make_engine_config(c.engine, model=c.model)
    if base.block_size != c.block:
        raise ValueError(f"engine.block_size={base.block_size} must equal block={c.block} (an "
                         "engine block is a trace block)")
    w = mooncake_trace.load_mooncake_trace(c.trace, window=tuple(c.window), block=c.block)
    w.check_fits(base.max_model_len)
    return {"base": base, "workload": w.time_scaled(c.time_scale)}


def distinct_blocks(c, w) -> int:
    rows = mooncake_trace.read(c.trace)
    return len({h for r in w.requests for h in rows.hash_ids[int(r.request_id.rsplit("-", 1)[1])]})


def window_setup(c, plan) -> tuple:
    """The window's workload, its distinct prompt blocks, the loaded model and the pool size
    (``pool_fraction`` of the distinct blocks, at least one sequence's worth, plus the null
    block): what this study and ``experiments/router_events.py`` both start from."""
    w = plan["workload"]
    distinct = distinct_blocks(c, w)
    num_blocks = max(int(c.pool_fraction * distinct), plan["base"].max_blocks_per_seq) + 1
    return w, distinct, common.load_model(c.model), num_blocks


class Recording(StepTimeModel):
    """``inner``'s times, keeping every shape asked (for the fit)."""

    name = "recording"

    def __init__(self, inner: StepTimeModel):
        self.inner, self.shapes = inner, []

    def time(self, shape) -> float:
        self.shapes.append(shape)
        return self.inner.time(shape)


def _accesses(block_manager) -> list:
    log: list = []
    block_manager.record_accesses(lambda d, h: log.append((len(d), h)))
    return log


def _rates(hit_tokens: int, log, w) -> dict:
    looked = sum(n for n, _ in log)
    return {"token_hit_rate": hit_tokens / sum(r.prompt_len for r in w.requests),
            "block_hit_rate": sum(h for _, h in log) / looked if looked else 0.0,
            "admissions": len(log), "prefix_cache_hit_tokens": hit_tokens}


def run_engine(cfg, model, w) -> tuple[dict, list[float]]:
    """The engine on the measured-step clock (module docstring); its rates and step times."""
    engine = Engine(cfg, model_config=model[0], params=model[1])
    engine.warmup(logprobs=False, parallel_sampling=False)
    log = _accesses(engine.block_manager)
    durations, t0 = [], time.perf_counter()
    clock = replay_arrivals(engine, w.requests, lambda start, d: durations.append(d))
    stats = engine.kv_stats()
    out = _rates(stats["prefix_cache_hit_tokens"], log, w)
    out.update(steps=len(durations), span_s=clock, wall_s=time.perf_counter() - t0,
               preemptions=stats["num_preemptions"])
    return out, durations


def run_sim(cfg, model_config, w, step_model) -> dict:
    sim = Simulator(cfg, step_model, model_config=model_config, build_device=False)
    log = _accesses(sim.replicas[0].block_manager)
    res = sim.run(w)
    s = res.summary
    out = _rates(s["prefix_cache_hit_tokens"], log, w)
    out.update(steps=s["num_engine_steps"], span_s=res.sim_s, completed=s["completed"],
               preemptions=s["engine_preemptions"])
    return out


def main(c, plan):
    out_dir = common.output_dir(c, STUDY)
    w, distinct, model, num_blocks = window_setup(c, plan)
    print(f"{c.trace} {tuple(c.window)} s x{c.time_scale:g}: {len(w)} requests, {distinct} "
          f"distinct prompt blocks, pool {num_blocks - 1} blocks ({w.label()})", flush=True)
    rows = []
    for policy in c.policies:
        cfg = dataclasses.replace(plan["base"], num_blocks=num_blocks, prefix_eviction=policy)
        eng, durations = run_engine(cfg, model, w)
        rec = Recording(ReplayStepModel(durations))
        replay = run_sim(cfg, model[0], w, rec)
        fitted_model = fit_linear(rec.shapes, durations[:len(rec.shapes)])
        fitted = run_sim(cfg, model[0], w, fitted_model)
        row = {"policy": policy, "engine": eng, "sim_replay": replay, "sim_fitted": fitted,
               "fit": fitted_model.describe()}
        for k in ("sim_replay", "sim_fitted"):
            row[f"{k}_gap_pp"] = {m: 100 * (row[k][m] - eng[m])
                                  for m in ("token_hit_rate", "block_hit_rate")}
        rows.append(row)
        print(f"  {policy}: engine token/block hit {eng['token_hit_rate']:.2%} / "
              f"{eng['block_hit_rate']:.2%}; sim replay {replay['token_hit_rate']:.2%} / "
              f"{replay['block_hit_rate']:.2%}; sim fitted {fitted['token_hit_rate']:.2%} / "
              f"{fitted['block_hit_rate']:.2%} [{eng['wall_s']:.0f} s]", flush=True)
    table = markdown(rows)
    (out_dir / f"{STUDY}.md").write_text(table + "\n")
    print(table)
    path = common.write_result(out_dir / f"{STUDY}.json", {
        "study": STUDY, "evidence": {"workload": "real", "engine": "real", "sim_replay": "simulated",
                                   "sim_fitted": "simulated"}, "workload": {
            "label": w.label(), "evidence": w.evidence, "requests": len(w),
            "distinct_prompt_blocks": distinct, "pool_blocks": num_blocks - 1,
            "meta": {k: v for k, v in w.meta.items() if k != "derived"},
            "derived": w.meta["derived"]},
        "rows": rows, "config": c.to_dict(),
        "provenance": {**common.provenance(), "load_average": list(os.getloadavg())}})
    print(f"wrote {path}")


def markdown(rows) -> str:
    lines = ["| policy | run | token hit rate | block hit rate | gap (token / block, pp) | "
             "steps | preemptions |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        for k in ("engine", "sim_replay", "sim_fitted"):
            x = r[k]
            gap = r.get(f"{k}_gap_pp")
            g = "-" if gap is None else (f"{gap['token_hit_rate']:+.2f} / "
                                         f"{gap['block_hit_rate']:+.2f}")
            lines.append(f"| {r['policy']} | {k} | {x['token_hit_rate']:.2%} | "
                         f"{x['block_hit_rate']:.2%} | {g} | {x['steps']} | "
                         f"{x['preemptions']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    common.run(STUDY, main, check)
