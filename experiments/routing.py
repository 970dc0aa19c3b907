"""Routing over data-parallel replicas: router policies, replica scaling, host time per step.

Three parts, one engine model (``config.model``), every engine warmed up before anything is timed
(no request pays for a compilation; ``num_compilations`` after warm-up is reported per run):

**Policies.** A constructed multi-tenant workload (`tenant_workload`: one system prompt per tenant,
of different lengths, shared by that tenant's users; each request's tenant drawn from the seed;
the user's own turn and the output lengths from `paged.workload.workload.make_workload`, Poisson arrivals
from the same call; evidence ``constructed``) is served in real time
(`experiments.serving.run_arm`: requests added at their arrival times with ``arrival_time``, the
engine stepping in between) on ``data_parallel_size`` replicas, once per router policy of
``config.routers``: the same requests, one engine, its router replaced and every replica's prefix
cache emptied between runs, ``config.repeats`` times (the order reversed every other time, so a
drift of a shared machine hits every policy alike; medians over repeats in ``by_policy``, every
run kept in ``policies``). Per policy: the prefix-cache hit rate (prompt tokens served from the
cache / prompt tokens of finished requests, from the requests' own counts), p50 / p99 TTFT and
TPOT, output and request throughput, and per replica the requests it served, its prompt tokens,
cache hits, tokens it computed (prompt tokens not from the cache + output tokens) with their
coefficient of variation (population std / mean) and max / mean over replicas (1 and 0 = even).

**Scaling.** A burst of requests of the same tenants (``scaling.rate``, all arriving within a
fraction of a second) on D = ``scaling.replicas``, ``scaling.repeats`` times (order reversed every
other time; medians in ``by_replicas``); output throughput against D = 1, and the
process's CPU seconds per wall second (how many cores the run kept busy) beside the cores the
machine has, which is what ends the scaling on a small machine.

**Host time per step.** One replica with ``num_running`` decoding sequences against
``host_bench.replicas`` replicas with ``num_running`` each: host time per step = the ``step()``
call's wall time minus the time it waited on devices (``last_timing.device``, summed over the
replicas, whose waits are disjoint since one thread waits on each in turn); medians over every
timed step (and per round, with the spread of the per-round ratios); rounds alternate which engine
goes first. Each round also times steps with every
replica's device call stubbed out (``isolated``: tokens of the right shape at once, the same host
code with no device work competing for the cores). The ratio D-replica / one-replica is reported
against ``host_bench.goal_ratio``.

What a "device" is here: on a CPU machine the D devices are ``--xla_force_host_platform_device_count``
host devices, partitions of the same CPU. Their computations share the machine's cores with each
other and with the host loop (``os.cpu_count()`` is recorded, with the load average before and
after, since other jobs share them too), so device work does not really run in parallel: D
replicas give D times the KV pool and D times the batch, not D times the compute. The study forces
4 host devices itself (``FORCED_DEVICES``) when ``XLA_FLAGS`` names no device count; it must be set before JAX
starts. Writes ``routing.json`` (everything, config, provenance), ``routing.png`` (hit rate and
p99 TTFT per policy, the scaling curve, the host-time ratio) and ``replay.json`` (every serving
run, named by its label; each starts cold on its reused engine, ``serving.start_cold``, so
``python -m experiments.replay --from=<dir>`` with the printed ``XLA_FLAGS`` re-executes it,
routing included).
"""

from __future__ import annotations

import os

# The imports below come after the flag on purpose: JAX reads XLA_FLAGS when it starts.
# ruff: noqa: E402
FORCED_DEVICES = 4
if __name__ == "__main__":  # before JAX starts
    from experiments.host_devices import force_host_devices

    force_host_devices(FORCED_DEVICES)

import dataclasses
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from experiments import common, plots, serving
from experiments import replay as replay_mod
from paged import Engine, SamplingParams
from paged.fleet.routing import POLICIES
from paged.workload.workload import BOS_ID, Workload, check_same_evidence, make_workload

_PER_REQUEST = ("input_lens", "output_lens", "ttfts", "itls", "errors", "error_messages",
                "failed_request_ids")


# --- the workload ------------------------------------------------------------------------------
def tenant_workload(w, num_requests: int, rate: float, seed: int) -> Workload:
    """``num_requests`` requests, each behind its tenant's system prompt (module docstring).

    Arrivals and the user's own turn and output lengths come from `make_workload` (drawn with room
    for the longest system prompt); each request's first ``1 + longest`` tokens (BOS + the shared
    prefix) are then replaced by BOS + its tenant's prompt. Tenants are drawn per request with
    probability ``~ 1 / rank ** tenant_zipf`` (0: uniform) from a stream of their own.
    ``shared_prefix_len`` is then BOS + the tenant's prompt: identical across that tenant's
    requests.
    """
    lens = [int(n) for n in w.tenant_prefix_lens]
    longest = max(lens)
    fixed = w.kind == "fixed"
    base = make_workload(w.kind, num_requests, rate, burstiness=w.burstiness,
                         max_model_len=w.length_context, seed=seed, shared_prefix_len=longest,
                         prompt_len=w.prompt_len if fixed else None,
                         output_len=w.output_len if fixed else None)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 7919]))
    prompts = [(BOS_ID,) + tuple(int(t) for t in rng.integers(0, 256, n)) for n in lens]
    weights = 1.0 / np.arange(1, len(lens) + 1) ** float(w.tenant_zipf)
    who = rng.choice(len(lens), size=num_requests, p=weights / weights.sum())
    reqs = []
    for r, g in zip(base.requests, who.tolist(), strict=True):
        own = r.prompt_token_ids[longest + 1:]
        reqs.append(dataclasses.replace(
            r, request_id=f"t{g}-{r.request_id}", prompt_token_ids=prompts[g] + own,
            prompt_len=len(prompts[g]) + len(own), shared_prefix_len=len(prompts[g])))
    meta = {**base.meta, "tenants": {
        "prefix_lens": lens, "zipf": float(w.tenant_zipf), "seed": [seed, 7919],
        "requests_per_tenant": np.bincount(who, minlength=len(lens)).tolist(),
        "rule": "request = BOS + its tenant's system prompt + the user's own turn "
                "(make_workload lengths, drawn with room for the longest prompt)"}}
    return dataclasses.replace(base, name=f"tenants{len(lens)}-{num_requests}",
                               requests=tuple(reqs), meta=meta)


# --- checks ------------------------------------------------------------------------------------
def _int(key: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key}={value!r} must be an integer >= {minimum}")
    return value


def host_engine_config(c, replicas: int):
    """The host bench's engine: one step shape, a pool that holds the bench's sequences."""
    h = c.host_bench
    steps = h.warmup_steps + h.rounds * 2 * (h.steps + 1)
    # Filling: prompts take num_running * prompt_len tokens at num_running a step, while the
    # sequences admitted first already decode; 2 * prompt_len + 8 steps is ample.
    length = h.prompt_len + steps + 2 * h.prompt_len + 8 + 16
    block = c.engine.block_size or 16
    num_blocks = max(h.num_running * (-(-length // block) + 1) + 1, c.engine.num_blocks or 0)
    tokens = max(h.num_running, c.engine.min_token_bucket)
    return common.make_engine_config(
        c.engine, model=c.model, where="host_bench engine", data_parallel_size=replicas,
        router="round_robin", max_num_seqs=h.num_running, max_num_batched_tokens=tokens,
        min_seq_bucket=h.num_running, min_token_bucket=tokens, num_blocks=num_blocks)


def check(c) -> dict:
    """Checks every setting; builds every EngineConfig and workload (no model yet)."""
    common.check_model(c.model)
    common.check_unset(c.engine, ["data_parallel_size", "router"],
                       "data_parallel_size / routers / scaling")
    common.check_positive(ttft_slo_ms=c.ttft_slo_ms, tpot_slo_ms=c.tpot_slo_ms,
                          max_wall_s=c.max_wall_s)
    routers = tuple(c.routers)
    bad = sorted(set(routers) - set(POLICIES))
    if bad or not routers or len(set(routers)) != len(routers):
        raise ValueError(f"routers={routers!r}: distinct policies of {POLICIES}")
    if c.scaling.router not in POLICIES:
        raise ValueError(f"scaling.router={c.scaling.router!r} must be one of {POLICIES}")
    d = _int("data_parallel_size", c.data_parallel_size, 1)
    _int("repeats", c.repeats, 1)
    _int("scaling.repeats", c.scaling.repeats, 1)
    scale = tuple(c.scaling.replicas)
    for i, n in enumerate(scale):
        _int(f"scaling.replicas[{i}]", n, 1)
    if len(set(scale)) != len(scale):
        raise ValueError(f"scaling.replicas={scale!r} must be distinct")
    h = c.host_bench
    _int("host_bench.replicas", h.replicas, 0)
    for key in ("num_running", "prompt_len", "steps", "rounds"):
        _int(f"host_bench.{key}", h[key], 1)
    _int("host_bench.warmup_steps", h.warmup_steps, 0)
    common.check_positive(**{"host_bench.goal_ratio": h.goal_ratio})
    w = c.workload
    lens = tuple(w.tenant_prefix_lens)
    if not lens:
        raise ValueError("workload.tenant_prefix_lens=() names no tenant")
    for i, n in enumerate(lens):
        _int(f"workload.tenant_prefix_lens[{i}]", n, 1)
    if isinstance(w.tenant_zipf, bool) or not w.tenant_zipf >= 0:
        raise ValueError(f"workload.tenant_zipf={w.tenant_zipf!r} must be >= 0")
    common.check_positive(**{"workload.rate": w.rate, "scaling.rate": c.scaling.rate})
    engines = {n: common.make_engine_config(c.engine, model=c.model, data_parallel_size=n,
                                            router=c.scaling.router)
               for n in sorted({d, *scale})}
    engines[d] = dataclasses.replace(engines[d], router=routers[0])
    host = {}
    if h.replicas:
        host = {1: host_engine_config(c, 1), h.replicas: host_engine_config(c, h.replicas)}
        if h.prompt_len + h.steps >= c.engine.max_model_len:
            raise ValueError(f"host_bench.prompt_len={h.prompt_len} leaves no room in "
                             f"engine.max_model_len={c.engine.max_model_len}")
    workloads = {}
    for name, num, rate, seed in (("policies", w.num_requests, w.rate, w.seed),
                                  ("scaling", c.scaling.num_requests, c.scaling.rate,
                                   c.scaling.seed)):
        if name == "scaling" and not scale:
            continue
        try:
            wl = tenant_workload(w, num, float(rate), seed)
            wl.check_fits(c.engine.max_model_len)
        except (ValueError, TypeError) as e:
            raise type(e)(f"workload ({name}): {e}") from None
        workloads[name] = wl
    evidence = check_same_evidence(list(workloads.values()))
    need = max([d, *scale, h.replicas])
    have = len(jax.devices())
    if need > have:
        raise ValueError(
            f"{need} replicas need {need} devices but JAX sees {have} ({jax.default_backend()}); "
            f"on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={need} before the run "
            "(the study sets 4 itself only when XLA_FLAGS is unset)")
    return {"engines": engines, "host_engines": host, "workloads": workloads,
            "evidence": evidence}


# --- measurement -------------------------------------------------------------------------------
def _spread(xs) -> dict:
    """Mean, coefficient of variation (population std / mean) and max / mean of ``xs``."""
    xs = [float(x) for x in xs]
    mean = statistics.fmean(xs) if xs else 0.0
    return {"values": xs, "mean": mean,
            "cv": statistics.pstdev(xs) / mean if mean else None,
            "max_over_mean": max(xs) / mean if mean else None}


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _reset(engine, policy: str) -> None:
    """Empties every replica's prefix cache and gives the engine a fresh ``policy`` router
    (``serving.start_cold``: the run starts as on a new engine, so it replays)."""
    engine.config = dataclasses.replace(engine.config, router=policy)
    serving.start_cold(engine)


def _replica_stats(engine) -> list[dict]:
    return [r.kv_stats() for r in getattr(engine, "replicas", [engine])]


def serve(c, engine, workload: Workload, policy: str, label: str) -> dict:
    """One real-time run of ``workload`` on the idle ``engine`` with router ``policy``."""
    _reset(engine, policy)
    n = len(getattr(engine, "replicas", [engine]))
    before, steps0, comp0 = _replica_stats(engine), engine.num_steps, engine.num_compilations
    load0, cpu0 = _loadavg(), time.process_time()
    arm = serving.run_arm(label, engine, workload, ttft_slo_ms=c.ttft_slo_ms,
                          tpot_slo_ms=c.tpot_slo_ms, max_wall_s=c.max_wall_s, progress=False,
                          model_name=c.model)
    routed = getattr(engine, "routed", {})  # request id -> replica (a single engine: none)
    cpu = time.process_time() - cpu0
    after = _replica_stats(engine)
    s = {k: v for k, v in arm.summary.items() if c.per_request or k not in _PER_REQUEST}
    # run_arm's engine counters are cumulative over the engine's life: this run's are below.
    for k in ("prefix_cache_hit_tokens", "engine_preemptions", "num_engine_steps"):
        s.pop(k, None)
    per = []
    for i in range(n):
        recs = [r for r in arm.records if r.status == "finished"
                and routed.get(r.request_id, 0) == i]
        prompt = sum(r.prompt_len for r in recs)
        cached = sum(r.num_cached_tokens for r in recs)
        output = sum(r.output_len for r in recs)
        b, a = before[i], after[i]
        per.append({
            "requests": len(recs), "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else None,
            "computed_tokens": prompt - cached + output, "output_tokens": output,
            "num_requests_served": a["num_requests_served"] - b["num_requests_served"],
            "prefix_cache_hit_tokens": a["prefix_cache_hit_tokens"]
            - b["prefix_cache_hit_tokens"],
            "preemptions": a["num_preemptions"] - b["num_preemptions"]})
    return {
        "label": label, "policy": policy, "data_parallel_size": n, "summary": s,
        "per_replica": per,
        "evenness": {"requests": _spread(p["requests"] for p in per),
                     "computed_tokens": _spread(p["computed_tokens"] for p in per)},
        "routed": dict(engine.router.num_routed) if n > 1 else {"only": len(workload)},
        "preemptions": sum(p["preemptions"] for p in per),
        "num_steps": engine.num_steps - steps0, "wall_s": arm.wall_s, "cpu_s": cpu,
        "ms_per_step": 1e3 * arm.wall_s / max(engine.num_steps - steps0, 1),
        "cores_busy": cpu / arm.wall_s if arm.wall_s else None,
        "loadavg_before": load0, "loadavg_after": _loadavg(),
        "num_compilations_during_run": engine.num_compilations - comp0,
        "replay": arm.replay}  # run() moves it to replay.json


_POLICY_KEYS = ("prefix_cache_hit_rate", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                "p99_tpot_ms", "output_throughput", "request_throughput", "completed")


def median_over(runs: list[dict]) -> dict:
    """Per statistic, the median over one policy's repeats (None if any run lacks it)."""
    def med(vals):
        return None if not vals or any(v is None for v in vals) else float(np.median(vals))

    out = {"repeats": len(runs)}
    for key in _POLICY_KEYS:
        out[key] = med([r["summary"].get(key) for r in runs])
    for what in ("requests", "computed_tokens"):
        for stat in ("cv", "max_over_mean"):
            out[f"{what}_{stat}"] = med([r["evenness"][what][stat] for r in runs])
    out["preemptions"] = med([r["preemptions"] for r in runs])
    out["cores_busy"] = med([r["cores_busy"] for r in runs])
    return out


_TABLE = (("hit rate %", "prefix_cache_hit_rate", 100, "{:.1f}"),
          ("p50 TTFT ms", "median_ttft_ms", 1, "{:.0f}"), ("p99 TTFT ms", "p99_ttft_ms", 1, "{:.0f}"),
          ("p50 TPOT ms", "median_tpot_ms", 1, "{:.1f}"), ("p99 TPOT ms", "p99_tpot_ms", 1, "{:.1f}"),
          ("output tok/s", "output_throughput", 1, "{:.0f}"),
          ("requests/s", "request_throughput", 1, "{:.2f}"),
          ("requests CV", "requests_cv", 1, "{:.3f}"),
          ("requests max/mean", "requests_max_over_mean", 1, "{:.2f}"),
          ("computed tok CV", "computed_tokens_cv", 1, "{:.3f}"),
          ("computed max/mean", "computed_tokens_max_over_mean", 1, "{:.2f}"),
          ("preemptions", "preemptions", 1, "{:.0f}"))


def format_policies(by: dict) -> str:
    """The per-policy table (medians over repeats)."""
    lines = [f"{'':20s}" + "".join(f"{p:>15s}" for p in by)]
    for label, key, scale, fmt in _TABLE:
        cells = ["-" if by[p][key] is None else fmt.format(scale * by[p][key]) for p in by]
        lines.append(f"{label:20s}" + "".join(f"{x:>15s}" for x in cells))
    return "\n".join(lines)


def _line(r: dict) -> str:
    s = r["summary"]
    hit = s.get("prefix_cache_hit_rate")
    ev = r["evenness"]
    return (f"{r['label']}: {s['completed']}/{s['num_requests']} done, hit rate "
            f"{'-' if hit is None else f'{100 * hit:.1f}%'}, TTFT p50/p99 "
            f"{_ms(s.get('median_ttft_ms'))}/{_ms(s.get('p99_ttft_ms'))} ms, TPOT p50/p99 "
            f"{_ms(s.get('median_tpot_ms'), 1)}/{_ms(s.get('p99_tpot_ms'), 1)} ms, "
            f"{s['output_throughput']:.0f} tok/s, {s['request_throughput']:.2f} req/s; per "
            f"replica requests {[int(x) for x in ev['requests']['values']]} (CV "
            f"{_f(ev['requests']['cv'])}), computed tokens CV {_f(ev['computed_tokens']['cv'])}, "
            f"max/mean {_f(ev['computed_tokens']['max_over_mean'])}; preemptions "
            f"{r['preemptions']}; {r['wall_s']:.1f} s wall, {r['ms_per_step']:.1f} ms/step, "
            f"{r['cores_busy']:.2f} cores busy")


def _ms(v, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _f(v) -> str:
    return "-" if v is None else f"{v:.2f}"


# --- host time per step ------------------------------------------------------------------------
_ZEROS: dict = {}


def _stub(params, cache, batch, prev):
    """No device work: tokens of the right shape at once, placed as the real step places its
    tokens (the previous step's), so the real step that follows sees the same input types and
    does not compile again."""
    n = max(batch.sample_rows.shape[0], prev.shape[0])
    sharding = getattr(prev, "sharding", None)
    key = (n, sharding)
    if key not in _ZEROS:
        zeros = np.zeros(n, np.int32)
        _ZEROS[key] = zeros if sharding is None else jax.device_put(zeros, sharding)
    return cache, _ZEROS[key]


class _Bench:
    """An engine of D replicas with ``num_running`` decoding sequences on each."""

    def __init__(self, engine, h, seed: int):
        self.engine, self.h = engine, h
        self.replicas = getattr(engine, "replicas", [engine])
        self.expect = h.num_running * len(self.replicas)
        rng = np.random.default_rng(seed)
        budget = engine.config.max_model_len - h.prompt_len
        params = SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True)
        for i in range(self.expect):
            engine.add_request(f"h{i}", [BOS_ID] + rng.integers(0, 256, h.prompt_len - 1).tolist(),
                               params)
        while any(r.scheduler.waiting or any(not s.is_decoding for s in r.scheduler.running)
                  for r in self.replicas):
            engine.step()
        for _ in range(h.warmup_steps):
            engine.step()
        self.rows = {"real": [], "isolated": []}
        self.busy = {"real": [], "isolated": []}  # process CPU s / wall s of each block

    def block(self, mode: str, round_: int) -> None:
        self.engine.set_device_step(_stub if mode == "isolated" else None)
        self.engine.step()  # the switch: its step reads back the last mode's step
        start, cpu0 = time.perf_counter(), time.process_time()
        for _ in range(self.h.steps):
            t0 = time.perf_counter()
            self.engine.step()
            wall = time.perf_counter() - t0
            t = self.engine.last_timing
            if t.num_seqs != self.expect:
                raise RuntimeError(f"expected {self.expect} decoding sequences, stepped "
                                   f"{t.num_seqs} (preempted?)")
            self.rows[mode].append({"round": round_, "wall": wall, "device": t.device,
                                    "phases": t.host,
                                    "schedule": t.schedule, "prepare": t.prepare,
                                    "postprocess": t.postprocess})
        self.busy[mode].append((time.process_time() - cpu0) / (time.perf_counter() - start))

    def close(self) -> None:
        self.engine.set_device_step(None)
        for rid in self.engine.unfinished_request_ids():
            self.engine.abort(rid)
        while self.engine.has_unfinished_requests() or self.engine.has_step_in_flight():
            self.engine.step()

    def summary(self, mode: str) -> dict:
        rows = self.rows[mode]
        med = lambda k: 1e3 * float(np.median([r[k] for r in rows]))
        return {"steps": len(rows), "median_step_ms": med("wall"),
                "median_device_wait_ms": med("device"),
                "median_host_ms": 1e3 * float(np.median([r["wall"] - r["device"] for r in rows])),
                "median_phases_ms": med("phases"), "median_schedule_ms": med("schedule"),
                "median_prepare_ms": med("prepare"), "median_postprocess_ms": med("postprocess"),
                "p90_host_ms": 1e3 * float(np.percentile([r["wall"] - r["device"] for r in rows],
                                                         90)),
                "cores_busy": float(np.median(self.busy[mode])),
                "round_median_host_ms": [
                    1e3 * float(np.median([r["wall"] - r["device"] for r in rows
                                           if r["round"] == i])) for i in range(self.h.rounds)]}


def host_bench(c, engines: dict) -> dict:
    """Host time per step: one replica vs ``host_bench.replicas`` (module docstring)."""
    h = c.host_bench
    d = h.replicas
    benches = {n: _Bench(engines[n], h, seed=n) for n in (1, d)}
    rounds = []
    for i in range(h.rounds):
        order = (1, d) if i % 2 == 0 else (d, 1)
        for mode in ("real", "isolated"):
            for n in order:
                benches[n].block(mode, i)
        rounds.append({"order": list(order)})
    out = {"num_running_per_replica": h.num_running, "replicas": d, "goal_ratio": h.goal_ratio,
           "definition": "host time per step = step() wall time - time waiting on the devices "
                         "(last_timing.device summed over replicas); median over timed steps; "
                         "phases = schedule + prepare + postprocess summed over replicas; "
                         "isolated = every replica's device call stubbed out",
           "rounds": rounds}
    for mode in ("real", "isolated"):
        one, many = benches[1].summary(mode), benches[d].summary(mode)
        per_round = [a / b for a, b in zip(many["round_median_host_ms"],
                                           one["round_median_host_ms"], strict=True)]
        out[mode] = {"1": one, str(d): many,
                     "host_ratio": many["median_host_ms"] / one["median_host_ms"],
                     "host_ratio_rounds": per_round,
                     "phases_ratio": many["median_phases_ms"] / one["median_phases_ms"],
                     "step_ratio": many["median_step_ms"] / one["median_step_ms"]}
    out["host_ratio"] = out["real"]["host_ratio"]
    out["meets_goal"] = out["host_ratio"] <= h.goal_ratio
    for b in benches.values():
        b.close()
    return out


# --- the study ---------------------------------------------------------------------------------
def machine() -> dict:
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return {"cpu_count": os.cpu_count(), "cpus_usable": affinity, "loadavg": _loadavg(),
            "backend": jax.default_backend(), "devices": [str(x) for x in jax.devices()],
            "xla_flags": os.environ.get("XLA_FLAGS"),
            "device_note": (
                "CPU devices are --xla_force_host_platform_device_count partitions of the same "
                f"{os.cpu_count()} cores: their computations share those cores with each other "
                "and with the host loop, so D replicas do not compute in parallel"
                if jax.default_backend() == "cpu" else "one accelerator per device")}


def build(config, model):
    t0 = time.perf_counter()
    engine = Engine(config, model_config=model[0], params=model[1])
    engine.warmup(logprobs=False, parallel_sampling=False)  # what the old warmup compiled
    return engine, time.perf_counter() - t0


def run(c, out_dir: Path, plan: dict | None = None) -> dict:
    plan = plan or check(c)
    mach = machine()
    print(f"machine: {mach['cpu_count']} CPU cores ({mach['cpus_usable']} usable), load "
          f"{mach['loadavg']}, {len(mach['devices'])} {mach['backend']} devices; "
          f"{mach['device_note']}", flush=True)
    wl = plan["workloads"]["policies"]
    print(f"workload: {len(wl)} requests of {len(c.workload.tenant_prefix_lens)} tenants "
          f"(system prompts {tuple(c.workload.tenant_prefix_lens)} tokens), Poisson "
          f"{c.workload.rate:g}/s, evidence={wl.evidence}", flush=True)
    model = common.load_model(c.model)
    engines, warmup_s = {}, {}

    def engine(n):
        if n not in engines:
            engines[n], warmup_s[n] = build(plan["engines"][n], model)
            print(f"D={n}: built and warmed up in {warmup_s[n]:.1f} s", flush=True)
        return engines[n]

    d = c.data_parallel_size
    ds = sorted(c.scaling.replicas)
    progress = common.Progress(c.repeats * len(c.routers) + c.scaling.repeats * len(ds),
                               "routing", unit="run", summary=False)
    policies, replays = [], []
    for k in range(c.repeats):  # the order alternates, so a drift of the machine hits all alike
        for policy in (c.routers if k % 2 == 0 else tuple(reversed(c.routers))):
            r = serve(c, engine(d), wl, policy, f"{policy} D={d} #{k}")
            replays.append(r.pop("replay"))
            r["repeat"] = k
            policies.append(r)
            print(_line(r), flush=True)
            progress.update(1)
    by = {p: median_over([r for r in policies if r["policy"] == p]) for p in c.routers}
    headline = {}
    if "prefix_aware" in by and "round_robin" in by:
        pa, rr = by["prefix_aware"], by["round_robin"]
        headline = {
            "hit_rate_prefix_aware": pa.get("prefix_cache_hit_rate"),
            "hit_rate_round_robin": rr.get("prefix_cache_hit_rate"),
            "hit_rate_ratio_pa_over_rr": _ratio(pa.get("prefix_cache_hit_rate"),
                                                rr.get("prefix_cache_hit_rate")),
            "p99_ttft_ms_prefix_aware": pa.get("p99_ttft_ms"),
            "p99_ttft_ms_round_robin": rr.get("p99_ttft_ms"),
            "p99_ttft_ratio_pa_over_rr": _ratio(pa.get("p99_ttft_ms"), rr.get("p99_ttft_ms"))}
        print(f"prefix_aware vs round_robin (medians over {c.repeats} repeats): hit rate "
              f"x{_f(headline['hit_rate_ratio_pa_over_rr'])}, p99 TTFT "
              f"x{_f(headline['p99_ttft_ratio_pa_over_rr'])} (< 1: prefix-aware faster)",
              flush=True)
    print(format_policies(by), flush=True)

    runs = []
    for k in range(c.scaling.repeats if ds else 0):
        for n in (ds if k % 2 == 0 else ds[::-1]):
            r = serve(c, engine(n), plan["workloads"]["scaling"], c.scaling.router,
                      f"scaling {c.scaling.router} D={n} #{k}")
            replays.append(r.pop("replay"))
            r["repeat"] = k
            runs.append(r)
            print(_line(r), flush=True)
            progress.update(1)
    progress.close()
    scaling = {"runs": runs, "by_replicas": []}
    for n in ds:
        mine = [r for r in runs if r["data_parallel_size"] == n]
        row = {"data_parallel_size": n, **median_over(mine),
               "ms_per_step": float(np.median([r["ms_per_step"] for r in mine]))}
        ones = {r["repeat"]: r for r in runs if r["data_parallel_size"] == 1}
        row["speedup_per_repeat"] = [
            _ratio(r["summary"]["output_throughput"],
                   ones[r["repeat"]]["summary"]["output_throughput"]) for r in mine
            if r["repeat"] in ones]
        scaling["by_replicas"].append(row)
    base = next((r for r in scaling["by_replicas"] if r["data_parallel_size"] == 1), None)
    for r in scaling["by_replicas"]:
        r["speedup_vs_1"] = None if base is None else _ratio(r["output_throughput"],
                                                             base["output_throughput"])
    if ds:
        print(f"scaling, medians over {c.scaling.repeats} repeats (output tok/s, speedup vs "
              "D=1 [per repeat], cores busy, ms/step): " + ", ".join(
                  f"D={r['data_parallel_size']} {r['output_throughput']:.0f} "
                  f"x{_f(r['speedup_vs_1'])} {[round(x, 2) for x in r['speedup_per_repeat']]} "
                  f"{r['cores_busy']:.2f} {r['ms_per_step']:.1f}" for r in scaling["by_replicas"])
              + f"; {mach['cpu_count']} CPU cores", flush=True)

    host = None
    if c.host_bench.replicas:
        engines.clear()  # the bench's engines have their own step shape and pool
        hosts = {}
        for n, cfg in plan["host_engines"].items():
            hosts[n], warmup_s[f"host_bench D={n}"] = build(cfg, model)
            print(f"host bench D={n}: built and warmed up in {warmup_s[f'host_bench D={n}']:.1f} "
                  "s", flush=True)
        host = host_bench(c, hosts)
        hd = c.host_bench.replicas
        for mode in ("real", "isolated"):
            x = host[mode]
            print(f"host bench ({mode}): host ms/step D=1 {x['1']['median_host_ms']:.2f}, "
                  f"D={hd} {x[str(hd)]['median_host_ms']:.2f} -> x{x['host_ratio']:.2f} "
                  f"(rounds {min(x['host_ratio_rounds']):.2f}..{max(x['host_ratio_rounds']):.2f}) "
                  f"(phases x{x['phases_ratio']:.2f}; step ms {x['1']['median_step_ms']:.2f} vs "
                  f"{x[str(hd)]['median_step_ms']:.2f}; cores busy {x['1']['cores_busy']:.2f} vs "
                  f"{x[str(hd)]['cores_busy']:.2f})", flush=True)
        print(f"host time ratio D={hd}/D=1: x{host['host_ratio']:.2f} against the goal "
              f"<= x{c.host_bench.goal_ratio:g}: {'met' if host['meets_goal'] else 'NOT met'}",
              flush=True)
        del hosts

    payload = {
        "study": "routing", "evidence": plan["evidence"], "config": c.to_dict(),
        "engine_configs": {str(n): dataclasses.asdict(e) for n, e in plan["engines"].items()},
        "workload": {"name": wl.name, "meta": wl.meta, "summary": wl.summary()},
        "machine": {**mach, "loadavg_after": _loadavg()}, "warmup_s": {str(k): v for k, v in
                                                                       warmup_s.items()},
        "definitions": {
            "hit_rate": "prompt tokens served from the prefix cache / prompt tokens, finished "
                        "requests (metrics.summarize prefix_cache_hit_rate)",
            "ttft_tpot": "metrics.summarize over finished requests: TTFT = first token - "
                         "arrival; TPOT = (last token - first token) / (output tokens - 1)",
            "evenness": "per replica: requests it served and tokens it computed (prompt tokens "
                        "not from the cache + output tokens); cv = population std / mean, "
                        "max_over_mean; 0 and 1 = perfectly even",
            "cores_busy": "process CPU seconds / wall seconds of the run"},
        "headline": headline, "by_policy": by, "policies": policies, "scaling": scaling,
        "host_bench": host,
        "provenance": common.provenance()}
    path = common.write_result(out_dir / "routing.json", payload)
    print(f"wrote {path}")
    if serving.write_replay_records(out_dir / "replay.json", replays):
        devices = max(replay_mod.num_devices(r) for r in replays if r is not None)
        print(f"replay: {replay_mod.replay_command(out_dir, devices=devices)}")
    try:
        plot(payload, out_dir / "routing.png")
        print(f"wrote {out_dir / 'routing.png'}")
    except ImportError as e:  # matplotlib missing: the JSON is the result
        print(f"no plot: {e}")
    return payload


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def plot(payload: dict, path: Path) -> Path:
    """Hit rate and p99 TTFT per policy, the scaling curve, the host-time bars."""
    plt = plots.pyplot()

    scal = payload["scaling"]["by_replicas"]
    panels = 2 + bool(scal) + bool(payload["host_bench"])
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.8))
    by = payload["by_policy"]
    names = list(by)
    d = payload["policies"][0]["data_parallel_size"] if payload["policies"] else 0
    reps = f"median of {by[names[0]]['repeats']}" if names else ""
    for ax, key, scale, color, label in (
            (axes[0], "prefix_cache_hit_rate", 100, "tab:blue", "prefix-cache hit rate (%)"),
            (axes[1], "p99_ttft_ms", 1, "tab:orange", "p99 TTFT (ms)")):
        ax.bar(names, [scale * (by[n][key] or 0) for n in names], color=color, alpha=0.8)
        for i, n in enumerate(names):  # each repeat
            ys = [scale * (r["summary"].get(key) or 0) for r in payload["policies"]
                  if r["policy"] == n]
            ax.plot([i] * len(ys), ys, "k.", ms=5)
        ax.set_ylabel(label)
        ax.set_title(f"{label.split(' (')[0]}, D={d} ({reps}; dots: runs)", fontsize=9)
    for ax in axes[:2]:
        ax.tick_params(axis="x", rotation=20)
        ax.grid(alpha=0.3, axis="y")
    k = 2
    if scal:
        ax = axes[k]
        k += 1
        xs = [r["data_parallel_size"] for r in scal]
        ys = [r["output_throughput"] for r in scal]
        ax.plot(xs, ys, marker="o", label="measured (median)")
        runs = payload["scaling"]["runs"]
        ax.plot([r["data_parallel_size"] for r in runs],
                [r["summary"]["output_throughput"] for r in runs], "k.", ms=5, label="runs")
        if 1 in xs:
            y1 = ys[xs.index(1)]
            ax.plot(xs, [y1 * x for x in xs], ls="--", color="gray", label="linear")
        ax.set_xlabel("replicas D")
        ax.set_ylabel("output throughput (tok/s)")
        ax.set_xticks(xs)
        ax.set_title(f"scaling on {payload['machine']['cpu_count']} CPU cores")
        ax.legend()
        ax.grid(alpha=0.3)
    if payload["host_bench"]:
        ax = axes[k]
        h = payload["host_bench"]
        hd = str(h["replicas"])
        modes = ("real", "isolated")
        x = np.arange(len(modes))
        ax.bar(x - 0.2, [h[m]["1"]["median_host_ms"] for m in modes], 0.4, label="D=1")
        ax.bar(x + 0.2, [h[m][hd]["median_host_ms"] for m in modes], 0.4, label=f"D={hd}")
        for i, m in enumerate(modes):
            ax.text(i + 0.2, h[m][hd]["median_host_ms"], f"x{h[m]['host_ratio']:.2f}",
                    ha="center", va="bottom", fontsize=9)
        ax.set_xticks(x, modes)
        ax.set_ylabel("host ms per step (median)")
        ax.set_title(f"host time, {h['num_running_per_replica']} seqs/replica")
        ax.legend()
        ax.grid(alpha=0.3, axis="y")
    plots.save(fig, path)
    return path


def main(c, plan):
    run(c, common.output_dir(c, "routing"), plan)


if __name__ == "__main__":
    common.run("routing", main, check)
