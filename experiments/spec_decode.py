"""Speculative decoding (n-gram and draft-model proposals): acceptance, tokens per verify step,
wall speed-up, and latency / throughput against offered load.

For each method, each k (``num_speculative_tokens``) and each constructed prompt kind (code-like,
prose-like; ``evidence: constructed``), at batch 1: the acceptance rate alpha per judged draft
(accepted / (accepted + rejections); vLLM's accepted / proposed is ``draft_acceptance_rate``),
the mean tokens emitted per verify step beside the expectation (1 - alpha^(k+1)) / (1 - alpha) for
k proposals accepted independently with probability alpha, the proposer's cost ratio c (time
spent proposing per proposal, over one plain target step: host lookup for n-gram, the draft
model's steps and cache mirroring for a draft model, measured), and the wall speed-up over plain decoding beside the
predicted (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)). Then throughput at larger batches with
speculation on and off, to show where it stops paying. Runs are greedy, so every speculative run
must produce exactly the plain run's tokens (checked). Plain and speculative runs alternate, and
medians over ``repeats`` are reported.

Where the expectation misses: it assumes every row proposes k tokens and that each judged draft
is accepted independently with one probability alpha. ``proposal_fill`` (proposed / (k x verify
rows)) says how far the first holds; ``expected_emitted_per_verify_row_k`` is the same formula
averaged over the verify rows with each row's own proposal length k_i (the fair comparison when
proposals are shorter than k); ``acceptance_by_position`` (accepted at draft position j over rows
that judged position j) tests the second: under the model it is flat at alpha.

Where the time goes (batch 1): each step's host phases and device wait (``StepTiming``) are
summed per run, so ``speedup`` = (plain steps / speculative steps) / ``step_cost_ratio`` (the
speculative step's wall over the plain step's), with the ratio split into device (verify width:
k + 1 scored and sampled slots instead of one) and host (proposing, reserving, rolling back).
For the draft method the draft's steps wait on the device inside the host phases, so there
``spec_propose_ms_per_step`` (draft steps and cache mirroring) is the split that means something.

Offered load (``load_*``): Poisson arrivals of the ``load_prompts`` prompts served in real time
(`experiments.serving.run_arm`: requests enter through ``add_request`` at their arrival times)
by an engine of ``load_max_num_seqs`` sequences with speculation off and on (``load_method`` /
``load_k``, by default the method and k of the best batch-1 speed-up measured above on those
prompts); per rate, medians over ``load_repeats`` (arms interleaved, their order alternating per
repeat; both arms of a repeat share its workload) of p50 / p99 TPOT, p50 TTFT and output-token
throughput. This shows where speculation stops paying as the batch fills. The engines are reused
(from batch 1 and the warm-up runs), so each timed run starts with an empty prefix cache
(``serving.start_cold``: no hit carries over from the warm-up run of the same workload) and is
recorded in ``replay.json`` (``python -m experiments.replay --from=<dir>``).
"""

from __future__ import annotations

import time

import numpy as np

from experiments import common, plots, serving
from experiments.replay import replay_command
from paged import Engine, SamplingParams, SpeculativeConfig
from paged.workload.distributions import poisson_arrivals
from paged.workload.workload import RequestSpec, Workload, byte_token_len

CODE = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
]
PROSE = [
    "The history of the city begins with a small settlement on the river, where traders met",
    "She walked along the shore in the early morning, thinking about the letter she had read",
    "In the spring the fields turn green again and the farmers return to their work, hoping",
]
PROMPTS = {"code": CODE, "prose": PROSE}


def check(c) -> dict:
    common.check_model(c.model)
    common.check_unset(c.engine, ["speculative", "max_num_seqs"], "ks / batch_sizes")
    methods = tuple(c.methods)
    if not methods or any(m not in ("ngram", "draft") for m in methods):
        raise ValueError(f"methods={methods!r} must name 'ngram' and/or 'draft'")
    for key in ("ks", "batch_sizes"):
        if not c[key] or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in c[key]):
            raise ValueError(f"{key}={tuple(c[key])!r} must be positive integers")
    common.check_positive(max_tokens=c.max_tokens, repeats=c.repeats)
    spec = {(m, k): SpeculativeConfig(method=m, model=c.draft_model, num_speculative_tokens=k,
                                      ngram_min=c.ngram_min, ngram_max=c.ngram_max)
            for m in methods for k in c.ks}
    configs = {}
    for b in sorted(set(c.batch_sizes) | {1}):
        configs[b, None] = common.make_engine_config(c.engine, model=c.model, max_num_seqs=b,
                                                     async_scheduling=False)
        for (m, k), s in spec.items():
            configs[b, m, k] = common.make_engine_config(c.engine, model=c.model, max_num_seqs=b,
                                                         speculative=s)
    return {"configs": configs, **_check_load(c, methods)}


def _check_load(c, methods) -> dict:
    """The offered-load sweep's engine configs (speculation off, and on for every candidate
    method / k) and one Poisson workload per (rate, repeat)."""
    if not c.load_rates:
        return {"load_configs": {}, "load_workloads": {}}
    for i, rate in enumerate(c.load_rates):
        common.check_positive(**{f"load_rates[{i}]": rate})
    if c.load_prompts not in PROMPTS:
        raise ValueError(f"load_prompts={c.load_prompts!r} must be one of {tuple(PROMPTS)}")
    for key in ("load_num_requests", "load_max_num_seqs", "load_repeats"):
        v = c[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{key}={v!r} must be an integer >= 1")
    common.check_positive(load_max_wall_s=c.load_max_wall_s)
    if c.load_method and c.load_method not in methods:
        raise ValueError(f"load_method={c.load_method!r} must be '' (the best measured) or one of "
                         f"methods={methods!r}")
    if isinstance(c.load_k, bool) or not isinstance(c.load_k, int) or c.load_k < 0 or (
            c.load_k and c.load_k not in tuple(c.ks)):
        raise ValueError(f"load_k={c.load_k!r} must be 0 (the best measured) or one of "
                         f"ks={tuple(c.ks)!r}")
    b = c.load_max_num_seqs
    if isinstance(c.load_min_seq_bucket, bool) or not isinstance(c.load_min_seq_bucket, int) or \
            not 1 <= c.load_min_seq_bucket <= b:
        raise ValueError(f"load_min_seq_bucket={c.load_min_seq_bucket!r} must be an integer in "
                         f"[1, load_max_num_seqs={b}]")
    size = {"max_num_seqs": b, "min_seq_bucket": c.load_min_seq_bucket}
    configs = {None: common.make_engine_config(c.engine, model=c.model, **size,
                                               async_scheduling=c.load_plain_async)}
    for m in methods:
        for k in c.ks:
            configs[m, k] = common.make_engine_config(
                c.engine, model=c.model, **size, speculative=SpeculativeConfig(
                    method=m, model=c.draft_model, num_speculative_tokens=k,
                    ngram_min=c.ngram_min, ngram_max=c.ngram_max))
    workloads = {(float(rate), r): load_workload(c.load_prompts, c.load_num_requests, float(rate),
                                                 c.max_tokens, seed=c.load_seed + 1000 * r + i)
                 for i, rate in enumerate(c.load_rates) for r in range(c.load_repeats)}
    return {"load_configs": configs, "load_workloads": workloads}


def load_workload(kind: str, num: int, rate: float, output_len: int, *, seed: int) -> Workload:
    """``num`` requests cycling through the ``kind`` prompts, Poisson arrivals at ``rate``/s
    (`paged.workload.distributions.poisson_arrivals`), ``output_len`` tokens each (EOS ignored)."""
    arrivals = poisson_arrivals(rate, num, seed=seed)
    prompts = PROMPTS[kind]
    requests = tuple(
        RequestSpec(request_id=f"{kind}-{i}", arrival_s=float(arrivals[i]), prompt_token_ids=None,
                    prompt=prompts[i % len(prompts)],
                    prompt_len=byte_token_len(prompts[i % len(prompts)]), output_len=output_len)
        for i in range(num))
    meta = {"source": "experiments.spec_decode.load_workload", "prompts": kind,
            "arrivals": {"process": "poisson", "rate": rate}, "output_len": output_len}
    return Workload(name=f"{kind}-poisson-{rate:g}", requests=requests, evidence="constructed",
                    seed=seed, meta=meta)


def _timed(obj, name: str, total: list[float]):
    """Wraps ``obj.name`` so its calls add their wall time to ``total[0]``; returns the original."""
    inner = getattr(obj, name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        out = inner(*args, **kwargs)
        if name == "mirror":  # dispatch is asynchronous: count the device work too
            obj.cache.k_pages.block_until_ready()
        total[0] += time.perf_counter() - t
        return out

    setattr(obj, name, timed)
    return inner


def _recorded(spec, rows: list[tuple[int, int]]):
    """Wraps ``spec.accept`` so each verify row appends (its proposal length k_i, its accepted
    drafts a_i) to ``rows``; returns the original."""
    inner = spec.accept

    def accept(seq, start, k, tokens, accepted, *args, **kwargs):
        ok = np.asarray(accepted[:k], bool)
        rows.append((k, k if ok.all() else int(np.argmin(ok))))
        return inner(seq, start, k, tokens, accepted, *args, **kwargs)

    spec.accept = accept
    return inner


def _run(engine: Engine, prompts: list[str], c, rows: list | None = None) -> dict:
    """One greedy run: its tokens, wall seconds, steps, proposing seconds and the summed step
    phases (``StepTiming``: host = schedule + prepare + postprocess, device = waiting for tokens);
    with ``rows``, the verify rows' (k_i, a_i) are appended to it."""
    params = SamplingParams(max_tokens=c.max_tokens, temperature=0.0, ignore_eos=True)
    steps0 = engine.num_steps
    propose = [0.0]
    spec = engine.speculator
    wrapped = []
    if spec is not None:  # time the proposing alone
        if spec.draft is None:
            wrapped.append((spec.proposer, "propose", _timed(spec.proposer, "propose", propose)))
        else:
            wrapped.append((spec, "draft_tokens", _timed(spec, "draft_tokens", propose)))
            wrapped.append((spec.draft, "mirror", _timed(spec.draft, "mirror", propose)))
        if rows is not None:
            wrapped.append((spec, "accept", _recorded(spec, rows)))
    phases = np.zeros(2)  # host, device seconds
    step = engine.step

    def timed_step():
        out = step()
        t = engine.last_timing
        phases[0] += t.host
        phases[1] += t.device
        return out

    engine.step = timed_step
    t0 = time.perf_counter()
    try:
        outs = engine.generate(prompts, params)
    finally:
        wall = time.perf_counter() - t0
        del engine.step  # the bound method again
        for obj, name, inner in wrapped:
            setattr(obj, name, inner)
    return {"tokens": [o.token_ids for o in outs], "wall": wall,
            "steps": engine.num_steps - steps0, "propose": propose[0],
            "host": float(phases[0]), "device": float(phases[1])}


def expected_emitted(alpha: float, k) -> np.ndarray | float:
    """(1 - alpha^(k+1)) / (1 - alpha): tokens per verify row when each of its k drafts is
    accepted independently with probability alpha (until the first rejection), plus one."""
    k = np.asarray(k, float)
    out = (k + 1.0) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return float(out) if out.ndim == 0 else out


def acceptance_by_position(rows: list[tuple[int, int]], k: int) -> list[float | None]:
    """Per draft position j = 1..k: rows that accepted draft j over rows that judged it (had
    k_i >= j and accepted drafts 1..j-1); ``None`` where no row judged it."""
    if not rows:
        return [None] * k
    ks, acc = np.asarray(rows).T
    out = []
    for j in range(1, k + 1):
        judged = int(((ks >= j) & (acc >= j - 1)).sum())
        out.append(float((acc >= j).sum() / judged) if judged else None)
    return out


def main(c, plan):
    out_dir = common.output_dir(c, "spec_decode")
    model_config, params = common.load_model(c.model)
    engines = {key: Engine(cfg, model_config=model_config, params=params)
               for key, cfg in plan["configs"].items()}
    kinds = PROMPTS
    for key, e in engines.items():  # compile the shapes each arm will see
        b = key[0]
        for kind in kinds.values():
            _run(e, (kind * b)[:b], c)
    rows = []
    methods = tuple(c.methods)
    arms = [(m, kind, 1, k) for m in methods for kind in kinds for k in c.ks]
    arms += [(m, "code", b, k) for m in methods for b in c.batch_sizes if b > 1 for k in c.ks]
    progress = common.Progress(len(arms), "spec_decode", unit="arm")
    for m, kind, b, k in arms:
        prompts = (kinds[kind] * b)[:b]
        plain, spec = engines[b, None], engines[b, m, k]
        runs_p, runs_s, verify = [], [], []
        before = spec.spec_decode_stats()
        for _ in range(c.repeats):  # interleaved
            want = _run(plain, prompts, c)
            got = _run(spec, prompts, c, verify)
            if got["tokens"] != want["tokens"]:
                raise AssertionError(f"speculation changed greedy tokens ({kind}, b={b}, k={k})")
            runs_p.append(want)
            runs_s.append(got)
        rows.append(_arm_row(m, kind, b, k, c, runs_p, runs_s, verify, before,
                             spec.spec_decode_stats()))
        progress.set(len(rows), arm=f"{m} {kind} b={b} k={k}")
    progress.close()
    for r in rows:
        print(f"{r['method']:5s} {r['prompts']:5s} b={r['batch']:3d} k={r['k']}  alpha {r['alpha']:.2f}  tokens/verify "
              f"{r['mean_emitted_per_verify']:.2f} (expected {r['expected_emitted_per_verify']:.2f}, "
              f"row k_i {r['expected_emitted_per_verify_row_k']:.2f}, fill {r['proposal_fill']:.2f})  "
              f"speed-up {r['speedup']:.2f} (predicted {r['predicted_speedup']:.2f}, "
              f"c {r['draft_cost_ratio_c']:.3f}, step cost x{r['step_cost_ratio']:.2f})")
    load, replays = None, []
    if c.load_rates:
        load = _load_sweep(c, plan, rows, model_config, params, engines, replays)
    path = common.write_result(out_dir / "spec_decode.json", {
        "study": "spec_decode", "evidence": "constructed", "config": c.to_dict(),
        "prompts": kinds, "results": rows, "load": load, "provenance": common.provenance()})
    _plot(rows, load, out_dir)
    print(f"wrote {path}")
    if serving.write_replay_records(out_dir / "replay.json", replays):
        print(f"replay (load runs): {replay_command(out_dir)}")


def _med(runs: list[dict], key: str) -> float:
    return float(np.median([r[key] for r in runs]))


def _arm_row(m, kind, b, k, c, runs_p, runs_s, verify, before, after) -> dict:
    drafts = after["num_drafts"] - before["num_drafts"]
    proposed = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    emitted = after["num_emitted_tokens"] - before["num_emitted_tokens"]
    rejected = after["num_rejections"] - before["num_rejections"]
    # Per judged draft: the drafts after a rejection are never judged.
    alpha = accepted / (accepted + rejected) if accepted + rejected else 0.0
    rate = accepted / proposed if proposed else 0.0
    expected = expected_emitted(alpha, k)
    row_ks = [ki for ki, _ in verify]
    expected_row = float(np.mean(expected_emitted(alpha, row_ks))) if row_ks else 0.0
    plain_wall, spec_wall = _med(runs_p, "wall"), _med(runs_s, "wall")
    plain_steps, spec_steps = int(_med(runs_p, "steps")), int(_med(runs_s, "steps"))
    step_s = plain_wall / max(1, plain_steps)  # one target step
    spec_step_s = spec_wall / max(1, spec_steps)
    # Per proposed token (a draft model's step makes one per sequence), per plain step.
    cost = _med(runs_s, "propose") / max(1, proposed // c.repeats // b) / step_s

    def per_step(runs, key):  # milliseconds per step
        return _med(runs, key) / max(1, int(_med(runs, "steps"))) * 1e3

    return {
        "method": m, "prompts": kind, "batch": b, "k": k, "alpha": alpha,
        "draft_acceptance_rate": rate,
        "verify_rows": drafts, "proposal_fill": proposed / (k * drafts) if drafts else 0.0,
        "mean_emitted_per_verify": emitted / drafts if drafts else 0.0,
        "expected_emitted_per_verify": expected,
        "expected_emitted_per_verify_row_k": expected_row,
        "acceptance_by_position": acceptance_by_position(verify, k),
        "draft_cost_ratio_c": cost,
        "plain_wall_s": plain_wall, "spec_wall_s": spec_wall,
        "speedup": plain_wall / spec_wall,
        "predicted_speedup": expected / (k * cost + 1),
        "plain_steps": plain_steps, "spec_steps": spec_steps,
        "plain_step_ms": step_s * 1e3, "spec_step_ms": spec_step_s * 1e3,
        "step_cost_ratio": spec_step_s / step_s,
        "plain_host_ms_per_step": per_step(runs_p, "host"),
        "plain_device_ms_per_step": per_step(runs_p, "device"),
        "spec_host_ms_per_step": per_step(runs_s, "host"),
        "spec_device_ms_per_step": per_step(runs_s, "device"),
        "spec_propose_ms_per_step": per_step(runs_s, "propose"),
        "plain_tokens_per_s": b * c.max_tokens / plain_wall,
        "spec_tokens_per_s": b * c.max_tokens / spec_wall,
    }


LOAD_STATS = ("median_tpot_ms", "p99_tpot_ms", "median_ttft_ms", "output_throughput")


def _load_sweep(c, plan, rows, model_config, params, engines, replays) -> dict:
    """TPOT, TTFT and throughput against offered load, speculation off and on (module docstring).
    ``replays`` gets each timed run's replay record (arm ``<off|on>@<rate>#<repeat>``)."""
    method, k = c.load_method, c.load_k
    if not method or not k:  # the best batch-1 speed-up measured on the load prompts
        best = max((r for r in rows if r["batch"] == 1 and r["prompts"] == c.load_prompts
                    and (not method or r["method"] == method) and (not k or r["k"] == k)),
                   key=lambda r: r["speedup"])
        method, k = best["method"], best["k"]
    configs = plan["load_configs"]
    reuse = {e.config: e for e in engines.values()}  # the same settings: compiled already
    arms = {}
    for name, cfg in (("off", configs[None]), ("on", configs[method, k])):
        arms[name] = reuse.get(cfg) or Engine(cfg, model_config=model_config, params=params)
    rates = [float(r) for r in c.load_rates]
    warm = {}
    for name, e in arms.items():  # compile: every plain shape, then one run per rate
        c0 = e.num_compilations
        if c.load_warmup:
            e.warmup(logprobs=False, parallel_sampling=False)
            for rate in rates:
                serving.run_arm("warmup", e, plan["load_workloads"][rate, 0], progress=False,
                                max_wall_s=c.load_max_wall_s)
        warm[name] = e.num_compilations - c0
    runs = {(rate, name): [] for rate in rates for name in arms}
    progress = common.Progress(len(rates) * c.load_repeats, "spec_decode load", unit="run")
    for r in range(c.load_repeats):
        order = list(arms) if r % 2 == 0 else list(arms)[::-1]
        for rate in rates:
            for name in order:
                e = arms[name]
                serving.start_cold(e)  # engines are reused: each timed run starts cold
                c0, before = e.num_compilations, e.spec_decode_stats()
                res = serving.run_arm(f"{name}@{rate:g}#{r}", e, plan["load_workloads"][rate, r],
                                      progress=False, max_wall_s=c.load_max_wall_s,
                                      model_name=c.model)
                replays.append(res.replay)
                s, after = res.summary, e.spec_decode_stats()
                drafts = after["num_drafts"] - before["num_drafts"]
                runs[rate, name].append({
                    **{key: s[key] for key in LOAD_STATS},
                    "completed": s["completed"], "num_requests": s["num_requests"],
                    "duration_s": s["duration"], "compilations": e.num_compilations - c0,
                    "mean_emitted_per_verify": (after["num_emitted_tokens"]
                                                - before["num_emitted_tokens"]) / drafts
                    if drafts else None})
            progress.set(r * len(rates) + rates.index(rate) + 1, repeat=r, rate=rate)
    progress.close()
    points = []
    for rate in rates:
        point = {"rate": rate}
        for name in arms:
            rs = runs[rate, name]
            point[name] = {key: _median_or_none([x[key] for x in rs]) for key in LOAD_STATS}
            point[name]["completed"] = min(x["completed"] for x in rs)
            point[name]["compilations"] = sum(x["compilations"] for x in rs)  # timed runs
            point[name]["runs"] = rs
        point["tpot_p50_ratio_on_off"] = _ratio(point["on"]["median_tpot_ms"],
                                                point["off"]["median_tpot_ms"])
        point["throughput_ratio_on_off"] = _ratio(point["on"]["output_throughput"],
                                                  point["off"]["output_throughput"])
        points.append(point)
        print(f"load {rate:6.1f} req/s  TPOT p50 off {point['off']['median_tpot_ms']:.2f} on "
              f"{point['on']['median_tpot_ms']:.2f} ms (x{point['tpot_p50_ratio_on_off']:.2f})  "
              f"p99 off {point['off']['p99_tpot_ms']:.2f} on {point['on']['p99_tpot_ms']:.2f}  "
              f"TTFT p50 off {point['off']['median_ttft_ms']:.1f} on "
              f"{point['on']['median_ttft_ms']:.1f}  tok/s off "
              f"{point['off']['output_throughput']:.0f} on {point['on']['output_throughput']:.0f}")
    return {"evidence": "constructed", "method": method, "k": k, "prompts": c.load_prompts,
            "max_num_seqs": c.load_max_num_seqs, "min_seq_bucket": c.load_min_seq_bucket,
            "num_requests": c.load_num_requests, "warmup_compilations": warm,
            "output_len": c.max_tokens, "plain_async_scheduling": c.load_plain_async,
            "workloads": {f"{rate:g}/{r}": w.meta | {"seed": w.seed, "num": len(w)}
                          for (rate, r), w in plan["load_workloads"].items()},
            "points": points}


def _median_or_none(xs):
    xs = [x for x in xs if x is not None]
    return float(np.median(xs)) if xs else None


def _ratio(a, b):
    return a / b if a is not None and b else None


def _plot(rows, load, out_dir) -> None:
    plt = plots.pyplot()

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    axes = axes.ravel()
    for m, kind in sorted({(r["method"], r["prompts"]) for r in rows}):
        rs = [r for r in rows if r["prompts"] == kind and r["batch"] == 1 and r["method"] == m]
        kind = f"{m} {kind}"
        ks = [r["k"] for r in rs]
        axes[0].plot(ks, [r["mean_emitted_per_verify"] for r in rs], "o-", label=f"{kind} measured")
        axes[0].plot(ks, [r["expected_emitted_per_verify"] for r in rs], "--", label=f"{kind} expected")
        axes[1].plot(ks, [r["speedup"] for r in rs], "o-", label=f"{kind} measured")
        axes[1].plot(ks, [r["predicted_speedup"] for r in rs], "--", label=f"{kind} predicted")
    for m, b in sorted({(r["method"], r["batch"]) for r in rows if r["batch"] > 1}):
        rs = [r for r in rows if r["batch"] == b and r["method"] == m]
        axes[1].plot([r["k"] for r in rs], [r["speedup"] for r in rs], "s:", label=f"{m} code b={b}")
    axes[0].set(xlabel="k", ylabel="tokens per verify step", title="batch 1")
    axes[1].set(xlabel="k", ylabel="wall speed-up vs plain")
    axes[1].axhline(1.0, color="gray", lw=0.5)
    if load:
        rates = [p["rate"] for p in load["points"]]
        label = {"off": "speculation off", "on": f"{load['method']} k={load['k']}"}
        for name, color in (("off", "C0"), ("on", "C3")):
            pts = [p[name] for p in load["points"]]
            axes[2].plot(rates, [p["median_tpot_ms"] for p in pts], "o-", color=color,
                         label=f"{label[name]} p50")
            axes[2].plot(rates, [p["p99_tpot_ms"] for p in pts], "s--", color=color,
                         label=f"{label[name]} p99")
            axes[3].plot(rates, [p["output_throughput"] for p in pts], "o-", color=color,
                         label=label[name])
        axes[2].set(xlabel="offered load (req/s, Poisson)", ylabel="TPOT (ms)", xscale="log",
                    title=f"{load['prompts']} prompts, max_num_seqs={load['max_num_seqs']}")
        axes[3].set(xlabel="offered load (req/s, Poisson)", ylabel="output tokens / s",
                    xscale="log")
        for ax in axes[2:]:
            ax.set_xticks(rates, [f"{r:g}" for r in rates])
            ax.minorticks_off()
    else:
        axes[2].set_visible(False)
        axes[3].set_visible(False)
    for ax in axes:
        if ax.get_visible():
            ax.legend(fontsize=7)
    fig.suptitle("speculative decoding (evidence: constructed prompts)", fontsize=9)
    plots.save(fig, out_dir / "spec_decode.png", dpi=120)


if __name__ == "__main__":
    common.run("spec_decode", main, check)
