"""The roofline checked on a device: one real trace window served by the real engine here, and the
same window simulated with `paged.sim.roofline.RooflineStepModel`.

Every LLM-scale number in ``experiments/results/`` is priced by the roofline at H200 figures and
was never compared with a GPU serving run. This study is that comparison, on whatever device it
runs: the real engine serves a window of the Azure conversation trace (``evidence: real``, its
derivations in the label) in real time; then `paged.sim.Simulator` runs the same requests, with
the same `EngineConfig`, under two step models: ``roofline_h200`` (``H200`` exactly as the fleet
studies use it) and ``roofline_measured`` (the same figures with this device's copy bandwidth,
measured first). Per variant: p50 / p99 TTFT and TPOT, throughput and steps, each with the
relative error ``(sim - real) / real``. The real side and the simulated sides keep their labels in
separate fields (``evidence``: ``{"real": ..., "sim": "simulated"}``).

    python -m experiments.sim_gpu_check                      # on a lent GPU (device_check.sh simval)
    python -m experiments.sim_gpu_check --config=experiments/configs/sim_gpu_check.py:smoke  # CPU

Writes ``sim_gpu_check.json`` to ``config.output_dir`` (default ``results/sim_gpu_check/<UTC>/``).
"""

from __future__ import annotations

import dataclasses
import time

from experiments import common, serving

METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "output_throughput",
           "request_throughput", "completed", "num_engine_steps", "engine_preemptions")


def check(c) -> dict:
    """Model, engine config and workload, validated before any weights load."""
    if c.random_model and c.random_model.to_dict():
        from paged.models.config import LlamaConfig

        try:
            model_cfg = LlamaConfig(**c.random_model.to_dict())
        except (TypeError, ValueError) as e:
            raise ValueError(f"random_model: {e}") from None
        model_name = None
    else:
        common.check_model(c.model)
        model_cfg, model_name = None, c.model
    common.check_positive(max_drain_s=c.max_drain_s, copy_bytes=c.copy_bytes)
    cfg = common.make_engine_config(c.engine, model=model_name or "random-small")
    workload = serving.real_workload(c.workload, cfg.max_model_len)
    if not len(workload):
        raise ValueError(f"workload.window={tuple(c.workload.window)}: no requests in it")
    return {"engine_config": cfg, "workload": workload, "model_cfg": model_cfg}


def load(c, plan):
    """``(LlamaConfig, params)``: random weights of ``random_model``, or ``config.model``."""
    if plan["model_cfg"] is None:
        return common.load_model(c.model)
    from paged.models.registry import init_params

    return plan["model_cfg"], init_params(plan["model_cfg"], 0)


def copy_bandwidth(nbytes: int, rounds: int = 10) -> float:
    """Bytes/s of a jitted ``x + 1`` over ``nbytes`` of float32 (read + write), best round."""
    import jax
    import jax.numpy as jnp

    x = jnp.zeros((max(nbytes // 4, 1),), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * x.size * 4 / best


def step_models(model, engine_config, bandwidth: float) -> dict:
    """The two roofline variants for this model's dimensions and weight storage."""
    import numpy as np

    from paged import sim as sm

    cfg, params = model
    leaves = __import__("jax").tree.leaves(params)
    dims = sm.ModelDims.from_llama_config(
        cfg, name="served", bytes_per_param=int(np.asarray(leaves[0]).dtype.itemsize),
        bytes_per_kv=np.dtype(engine_config.dtype).itemsize if engine_config.dtype != "bfloat16"
        else 2).with_kv_cache(engine_config)
    measured = dataclasses.replace(
        sm.H200, name="H200 figures, measured copy bandwidth", mem_bandwidth=bandwidth,
        source=f"{sm.H200.source}; bandwidth replaced by this device's measured copy "
               f"{bandwidth / 1e9:.0f} GB/s")
    bs = engine_config.block_size
    return {"roofline_h200": sm.RooflineStepModel(sm.H200, dims, block_size=bs),
            "roofline_measured": sm.RooflineStepModel(measured, dims, block_size=bs)}


def rel(sim, real):
    if sim is None or real in (None, 0):
        return None
    return (sim - real) / real


def main(c, plan) -> None:
    from paged.fleet.routing import Router
    from paged.sim import Simulator

    cfg, w = plan["engine_config"], plan["workload"]
    out_dir = common.output_dir(c, "sim_gpu_check")
    model = load(c, plan)
    bandwidth = copy_bandwidth(c.copy_bytes)
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; {len(w)} requests ({w.label()})", flush=True)
    engine = serving.build_engine(cfg, model)
    real = serving.run_arm("real", engine, w, max_wall_s=w.duration_s + c.max_drain_s,
                           progress=False, model_name=c.model)
    rs = real.summary
    row = {"real": {k: rs.get(k) for k in METRICS}}
    for name, sm in step_models(model, cfg, bandwidth).items():
        res = Simulator(cfg, sm, num_replicas=1, router=Router("least_loaded"),
                        model_config=model[0], build_device=False).run(
            w, max_time_s=w.duration_s + c.max_drain_s)
        s = res.summary
        row[name] = {k: s.get(k) for k in METRICS}
        row[f"{name}_rel_error"] = {k: rel(s.get(k), rs.get(k)) for k in METRICS[:6]}
        row[f"{name}_device"] = dataclasses.asdict(sm.device)
        print(f"{name}: " + ", ".join(
            f"{k} {s.get(k) or 0:.2f} (real {rs.get(k) or 0:.2f})" for k in METRICS[:4]), flush=True)
    path = common.write_result(out_dir / "sim_gpu_check.json", {
        "study": "sim_gpu_check",
        "evidence": {"real": rs["evidence"], "sim": "simulated"},
        "workload": {"label": w.label(), "num_requests": len(w), "duration_s": w.duration_s,
                     "derived": w.meta.get("derived", [])},
        "engine_config": dataclasses.asdict(cfg), "copy_bandwidth_bytes_s": bandwidth,
        "results": row, "config": c.to_dict()})
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    common.run("sim_gpu_check", main, check)
