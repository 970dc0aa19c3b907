"""Colocated replicas against prefill/decode splits on the CPU engine: a FUNCTIONAL CHECK.

Every arm serves the same constructed workload (``paged.workload.workload.make_workload``, evidence
``constructed``) in real time (`experiments.serving.run_arm`) on ``data_parallel_size`` replicas
with ``prefill_replicas`` = each value of ``config.splits`` (0 = colocated). Per arm: the serving
summary (TTFT / TPOT percentiles, goodput under the SLOs), and per replica its role, the tokens it
computed in prompt chunks, decode rows and recompute chunks, the KV bytes it sent or received,
and the hand-overs' byte counts and times (``engine.handover.records``). Each arm also checks that
every request finished and that prefill replicas never decoded and decode replicas never ran a
prompt chunk.

What this is not: a performance comparison. The four "devices" are forced host devices, slices
of the same CPU that the host loop and other jobs share (the load average is recorded), and a
hand-over is a copy between them, not a link. Disaggregation's case (prefill and decode not
delaying each other on separate accelerators) needs separate accelerators; the simulator study
answers it. Writes ``disagg_engine.json`` (``functional_check: true``) and ``replay.json`` (each
arm, a new engine each: ``python -m experiments.replay --from=<dir>`` with the printed
``XLA_FLAGS`` re-executes it, routing and hand-overs included).
"""

from __future__ import annotations

import os

# The imports below come after the flag on purpose: JAX reads XLA_FLAGS when it starts.
# ruff: noqa: E402
FORCED_DEVICES = 4
if __name__ == "__main__":  # before JAX starts
    from experiments.host_devices import force_host_devices

    force_host_devices(FORCED_DEVICES)

import statistics

import jax

from experiments import common, serving
from experiments.replay import replay_command
from paged.workload.workload import make_workload

NOTE = ("functional check on forced CPU host devices sharing one machine: not a performance "
        "claim; hand-over times are copies between host devices, not a link")


def check(config):
    common.check_positive(data_parallel_size=config.data_parallel_size,
                          num_requests=config.workload.num_requests, rate=config.workload.rate)
    engines = [common.make_engine_config(config.engine, model=config.model,
                                         data_parallel_size=config.data_parallel_size,
                                         prefill_replicas=p) for p in config.splits]
    w = config.workload
    fixed = w.kind == "fixed"
    workload = make_workload(w.kind, w.num_requests, w.rate, max_model_len=engines[0].max_model_len,
                             seed=w.seed, prompt_len=w.prompt_len if fixed else None,
                             output_len=w.output_len if fixed else None)
    return engines, workload


def _replicas(engine) -> list[dict]:
    keys = ("role", "num_prefill_tokens", "num_decode_tokens", "num_recompute_tokens",
            "kv_transfer_bytes", "kv_transfer_wire_bytes", "num_handovers", "num_preemptions",
            "prefix_cache_hit_tokens", "num_requests_served")
    return [{k: r[k] for k in keys} for r in engine.kv_stats()["replicas"]]


def _handovers(engine) -> dict | None:
    if engine.handover is None:
        return None
    recs = engine.handover.records
    secs = [r.seconds for r in recs if r.seconds is not None]
    return {"count": len(recs), "bytes": sum(r.bytes for r in recs),
            "wire_bytes": sum(r.wire_bytes for r in recs),
            "hit_tokens": sum(r.hit_tokens for r in recs),
            "median_seconds": statistics.median(secs) if secs else None,
            "max_seconds": max(secs) if secs else None}


def main(config, plan) -> None:
    engines, workload = plan
    if len(jax.devices()) < config.data_parallel_size:
        common.fail("disagg_engine", f"{len(jax.devices())} devices, data_parallel_size="
                    f"{config.data_parallel_size}: set XLA_FLAGS=--xla_force_host_platform_"
                    f"device_count={config.data_parallel_size} (or leave the device count out of XLA_FLAGS)")
    model = common.load_model(config.model)
    out = common.output_dir(config, "disagg_engine")
    load_before = os.getloadavg()
    arms, replays = [], []
    bar = common.Progress(len(engines), "disagg_engine", unit="arms", lines=True)
    for p, engine_config in zip(config.splits, engines):
        name = "colocated" if p == 0 else f"P:D={p}:{config.data_parallel_size - p}"
        engine = serving.build_engine(engine_config, model)
        arm = serving.run_arm(name, engine, workload, ttft_slo_ms=config.ttft_slo_ms,
                              tpot_slo_ms=config.tpot_slo_ms, max_wall_s=config.max_wall_s,
                              progress=False, model_name=config.model)  # one line per arm below
        replays.append(arm.replay)  # a new engine per arm: each replays
        replicas = _replicas(engine)
        roles_kept = all(r["num_decode_tokens"] == 0 for r in replicas if r["role"] == "prefill") \
            and all(r["num_prefill_tokens"] == 0 for r in replicas if r["role"] == "decode")
        s = arm.summary
        arms.append({"name": name, "prefill_replicas": p, "wall_s": arm.wall_s,
                     "roles_kept": roles_kept,
                     "all_finished": s["completed"] == len(workload.requests),
                     "summary": {k: s.get(k) for k in (
                         "completed", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                         "p99_tpot_ms", "request_goodput", "output_throughput")},
                     "replicas": replicas, "handovers": _handovers(engine)})
        print(f"{name}: {s['completed']} done, p50 TTFT {s['median_ttft_ms']} ms, "
              f"p50 TPOT {s['median_tpot_ms']} ms, roles kept {roles_kept} ({NOTE})", flush=True)
        bar.set(len(arms), arm=name)
    bar.close()
    payload = {"study": "disagg_engine", "functional_check": True, "note": NOTE,
               "evidence": workload.evidence, "config": config.to_dict(),
               "load_before": load_before, "load_after": os.getloadavg(),
               "cpu_count": os.cpu_count(), "arms": arms, "provenance": common.provenance()}
    path = common.write_result(out / "disagg_engine.json", payload)
    print(f"wrote {path}", flush=True)
    if serving.write_replay_records(out / "replay.json", replays):
        print(f"replay: {replay_command(out, devices=config.data_parallel_size)}", flush=True)
    if not all(a["all_finished"] and a["roles_kept"] for a in arms):
        common.fail("disagg_engine", "an arm left requests unfinished or crossed its roles")


if __name__ == "__main__":
    common.run("disagg_engine", main, check)
