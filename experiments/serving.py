"""Shared driver of the serving studies: one engine, one workload, in real time.

Requests are admitted at their arrival times (wall clock since the start of the run); engine steps
run in between; when nothing is in flight the driver sleeps until the next arrival. A request's
arrival time is its scheduled arrival, so a request that arrives during a step waits for it, as it
would in a server. Every request ends up in the results: finished, aborted (past the run's wall
limit), timed out, or rejected (the engine refused it), and the summary says which population its
percentiles cover.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

from experiments import common
from paged import Engine, EngineConfig, SamplingParams
from paged.workload import metrics
from paged.workload.workload import Workload, load_azure_trace, make_workload

STATUS = {"stop": "finished", "length": "finished", "abort": "aborted", "timeout": "timeout"}


@dataclasses.dataclass(frozen=True)
class ArmResult:
    name: str
    summary: dict  # metrics.summarize(...) plus engine counters
    records: list[metrics.RequestRecord]
    trace: dict  # metrics.Trace.to_dict()
    engine_config: dict
    wall_s: float
    num_compilations: int
    replay: dict | None = None  # what `experiments.replay` needs to run it again (`replay_record`)


def build_engine(engine_config: EngineConfig, model) -> Engine:
    """An engine on ``model=(config, params)`` (see `experiments.common.load_model`), warmed up."""
    engine = Engine(engine_config, model_config=model[0], params=model[1])
    engine.warmup(logprobs=False, parallel_sampling=False)  # what the old warmup compiled
    return engine


def request_params(output_len: int, n: int = 1) -> SamplingParams:
    """The sampling parameters a serving run gives a request (greedy, ``output_len`` tokens)."""
    return SamplingParams(max_tokens=output_len, temperature=0.0, n=n, ignore_eos=True)


def _record(out, spec_by_id) -> metrics.RequestRecord:
    spec = spec_by_id[out.request_id]
    status = STATUS[out.finish_reason] if out.finish_reason in STATUS else "aborted"
    times = tuple(out.token_times)
    finished = status == "finished"
    return metrics.RequestRecord(
        request_id=out.request_id, status=status, arrival_s=out.arrival_time,
        first_scheduled_s=out.first_scheduled_time, first_token_s=out.first_token_time,
        finish_s=out.finish_time if finished else (out.finish_time or time.perf_counter()),
        token_times=times, prompt_len=spec.prompt_len, output_len=len(out.token_ids),
        num_preemptions=out.num_preemptions, num_cached_tokens=out.num_cached_tokens)


def run_arm(name: str, engine: Engine, workload: Workload, *, ttft_slo_ms=None, tpot_slo_ms=None,
            max_wall_s: float = float("inf"), trace_every_s: float = 0.05,
            progress: bool = True, timeouts: dict[str, float] | None = None,
            model_name: str | None = None) -> ArmResult:
    """Serves ``workload`` with ``engine`` in real time and summarizes it.

    Args:
      name: the arm's label.
      engine: a fresh (warmed-up) engine.
      workload: requests with arrival offsets in seconds.
      ttft_slo_ms, tpot_slo_ms: SLO for goodput.
      max_wall_s: after this long, requests still in flight are aborted and later arrivals are
        rejected (both stay in the results as such).
      trace_every_s: period of the KV-usage trace samples.
      progress: show progress on stderr (`experiments.common.Progress`): True = a bar on a
        terminal and one summary line off it; "tty" = the bar only (for studies that print their
        own line per run); False = nothing.
      timeouts: per request id, a timeout in seconds since arrival (``add_request``'s
        ``timeout_s``; default the engine's ``request_timeout_s``).
      model_name: what `experiments.common.load_model` loads to rebuild the weights for a replay
        (the study's ``config.model``, e.g. ``"random-small"``); default ``engine.config.model``.

    The result's ``replay`` is what ``experiments.replay`` needs to re-execute the run in lockstep
    (``replay_record``); it replays only a run that started cold (``cold_start``): a study that
    reuses an engine calls ``engine.reset_prefix_cache()`` before each run.
    """
    specs = sorted(workload.requests, key=lambda r: r.arrival_s)
    spec_by_id = {r.request_id: r for r in specs}
    records: dict[str, metrics.RequestRecord] = {}
    trace = metrics.Trace()
    t0 = time.perf_counter()
    next_trace = 0.0
    i = 0
    bar = common.Progress(len(specs), f"[{name}]", summary=progress is True) if progress else None
    # The exact-replay log: per engine.step() call, what the driver did before it and what it
    # reported; the engine records each step's batch (record_steps; per replica when data
    # parallel), a data-parallel engine each request's replica (``routed``).
    fresh = cold_start(engine)  # a replay starts on a new engine: only a cold run replays
    engine_steps = engine.record_steps()
    steps: list[dict] = []
    added: list[str] = []
    tokens: dict[str, list[int]] = {}
    while i < len(specs) or engine.has_unfinished_requests():
        now = time.perf_counter()
        if now - t0 > max_wall_s:
            _stop(engine, specs[i:], records, spec_by_id, now, steps, added, tokens)
            break
        while i < len(specs) and t0 + specs[i].arrival_s <= now:
            r = specs[i]
            try:
                engine.add_request(r.request_id, r.engine_prompt(), request_params(r.output_len, r.n),
                                   arrival_time=t0 + r.arrival_s,
                                   timeout_s=(timeouts or {}).get(r.request_id))
                added.append(r.request_id)
            except ValueError:
                records[r.request_id] = _rejected(r, t0)
            i += 1
        if engine.has_unfinished_requests():
            _logged_step(engine, steps, added, records, spec_by_id, tokens)
        elif i < len(specs):
            time.sleep(max(0.0, t0 + specs[i].arrival_s - time.perf_counter()))
        now = time.perf_counter()
        if now - t0 >= next_trace:
            _sample(trace, engine, now - t0)
            next_trace = now - t0 + trace_every_s
            if bar is not None:
                bar.set(len(records), running=len(engine.scheduler.running),
                        waiting=len(engine.scheduler.waiting))
    wall = time.perf_counter() - t0
    if bar is not None:
        bar.set(len(records))
        bar.close()
    recs = [records[r.request_id] for r in specs]
    end = max([r.finish_s for r in recs if r.finish_s is not None], default=t0 + wall)
    summary = metrics.summarize(recs, duration_s=max(end - t0, 1e-9), ttft_slo_ms=ttft_slo_ms,
                                tpot_slo_ms=tpot_slo_ms, evidence=workload.evidence)
    stats = engine.kv_stats()
    summary.update(
        num_engine_steps=engine.num_steps, engine_preemptions=stats["num_preemptions"],
        prefix_cache_hit_tokens=stats["prefix_cache_hit_tokens"],
        peak_used_blocks=stats["block_manager"].get("peak_used_blocks"),
        pool_bytes=stats["ledger"]["pool_bytes"], kv_block_size=stats["block_size"],
        kv_num_blocks=stats["num_blocks"])
    replay = replay_record(name, engine.config, workload, spec_by_id, steps, engine_steps,
                           tokens, {r.request_id: r.status for r in recs}, fresh=fresh,
                           model_name=model_name, routed=getattr(engine, "routed", None))
    return ArmResult(name=name, summary=summary, records=recs, trace=trace.to_dict(),
                     engine_config=dataclasses.asdict(engine.config), wall_s=wall,
                     num_compilations=engine.num_compilations, replay=replay)


def _logged_step(engine, steps, added, records, spec_by_id, tokens) -> None:
    """One ``engine.step()``, logged for replay: the requests added before it (``added``,
    emptied), the requests it reported finished."""
    finished = []
    for out in engine.step():
        if out.finished:
            records[out.request_id] = _record(out, spec_by_id)
            tokens[out.request_id] = list(out.token_ids)
            finished.append(out.request_id)
    steps.append({"added": list(added), "finished": finished})
    added.clear()


def cold_start(engine) -> bool:
    """Whether a run on ``engine`` starts as it would on a new engine: nothing in flight, no
    cached prefix block (device pool or host tier) and, data parallel, a router that has routed
    nothing yet (its round-robin position is where a new one's is). A reused engine is cold again
    after ``engine.reset_prefix_cache()`` (and, data parallel, a new ``engine.router``)."""
    if engine.has_unfinished_requests():
        return False
    stats = engine.kv_stats()
    if stats["num_cached_blocks"] or stats["host_tier"]["used_blocks"]:
        return False
    router = getattr(engine, "router", None)  # data parallel only
    return router is None or not sum(router.num_routed.values())


def start_cold(engine) -> bool:
    """Makes a reused engine start its next run as a new engine would (``cold_start``), so the
    run replays: reads back a step still in flight (a run stopped at its wall limit leaves one),
    empties the prefix cache (``engine.reset_prefix_cache()``) and, data parallel, gives the
    engine a new router of its policy (``engine.router``: its round-robin position restarts).

    Returns:
      Whether the prefix cache was emptied: False with a host tier (``reset_prefix_cache``
      refuses; the next run is recorded as warm and its replay refused in one line).

    Raises:
      RuntimeError: a request is still unfinished.
    """
    while engine.has_unfinished_requests() and not engine.unfinished_request_ids():
        engine.step()  # only aborts to report or a step to read back
    if engine.unfinished_request_ids():
        raise RuntimeError(f"start_cold: requests still unfinished: "
                           f"{engine.unfinished_request_ids()[:4]}")
    if getattr(engine, "router", None) is not None:  # data parallel
        from paged.fleet.routing import Router

        engine.router = Router(engine.config.router, engine.config.router_load_threshold)
    return engine.reset_prefix_cache()


def replay_record(name, config, workload, spec_by_id, steps, engine_steps, tokens,
                  statuses, *, fresh: bool = True, model_name: str | None = None,
                  routed: dict[str, int] | None = None) -> dict:
    """What an exact replay of one serving run needs (written as ``replay.json``): the engine
    config and model, the workload's identity and every admitted request (prompt token ids or
    text, sampling, arrival offset, and with ``routed`` (data parallel) the replica it was routed
    to; a SHA-256 digest over them), and per ``engine.step()`` call the requests added before it,
    the requests it reported aborted or timed out (``ended``), its batch (``[request_id,
    sample_index, num_new_tokens]``; data parallel: one such list per replica), its preemptions
    (per replica, data parallel) and the requests it reported finished; the final token ids and
    status of every request. ``fresh``: the run started cold (``cold_start``)."""
    if len(steps) != len(engine_steps):
        raise RuntimeError(f"{len(steps)} driver steps but {len(engine_steps)} engine records")
    order = [rid for s in steps for rid in s["added"]]
    requests = []
    for rid in order:
        spec = spec_by_id[rid]
        prompt = spec.engine_prompt()  # token ids, or text the engine encodes
        requests.append({"request_id": rid, "prompt": prompt,
                         "output_len": spec.output_len, "n": spec.n, "arrival_s": spec.arrival_s})
        if routed is not None:
            requests[-1]["replica"] = routed[rid]
    digest = hashlib.sha256(json.dumps(requests, sort_keys=True).encode()).hexdigest()
    return {
        "version": 1, "arm": name,
        "model": config.model if model_name is None else model_name, "fresh_engine": fresh,
        "engine_config": dataclasses.asdict(config), "seed": config.seed,
        "workload": {"name": workload.name, "seed": workload.seed, "evidence": workload.evidence,
                     "label": workload.label(), "digest": digest},
        "requests": requests,
        "steps": [{**d, **e} for d, e in zip(steps, engine_steps)],
        "tokens": tokens, "statuses": statuses}


def write_replay(path, results, real_results=()) -> Path | None:
    """Writes the arms' replay records (``ArmResult.replay``) as ``path`` (``replay.json``, for
    ``python -m experiments.replay --from=<its dir>``); arms of ``real_results`` are named
    ``real_arrivals/<name>``. None (nothing written) when no arm has one."""
    arms = [r.replay for r in results if r.replay is not None]
    arms += [{**r.replay, "arm": f"real_arrivals/{r.name}"} for r in real_results
             if r.replay is not None]
    return write_replay_records(path, arms)


def write_replay_records(path, records: list[dict]) -> Path | None:
    """Writes replay records (one per run, each named by its ``arm``, names distinct) as
    ``path``; None (nothing written) for none."""
    arms = [r for r in records if r is not None]
    if not arms:
        return None
    names = [a["arm"] for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"replay records' arm names {names} must be distinct")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"arms": arms}, separators=(",", ":")) + "\n")  # compact: big
    return path


def _sample(trace: metrics.Trace, engine: Engine, t: float) -> None:
    stats = engine.kv_stats()
    trace.record(t, num_running=stats["num_running"], num_waiting=stats["num_waiting"],
                 num_swapped=stats["num_swapped"], batch_tokens=engine.last_timing.num_tokens,
                 ledger=stats["ledger"]["categories"])


def _rejected(spec, t0: float) -> metrics.RequestRecord:
    return metrics.RequestRecord(
        request_id=spec.request_id, status="rejected", arrival_s=t0 + spec.arrival_s,
        first_scheduled_s=None, first_token_s=None, finish_s=None, token_times=(),
        prompt_len=spec.prompt_len, output_len=0)


def _stop(engine: Engine, unadmitted, records, spec_by_id, now: float, steps, added,
          tokens) -> None:
    """Wall limit reached: abort what is in flight, reject what has not arrived yet."""
    in_flight = [rid for rid in engine.unfinished_request_ids() if rid not in records]
    for rid in in_flight:
        engine.abort(rid)
    _logged_step(engine, steps, added, records, spec_by_id, tokens)  # reports the aborted ones
    for spec in unadmitted:
        records[spec.request_id] = _rejected(spec, now)


def build_workload(w, max_model_len: int, *, time_scale: bool = True) -> Workload:
    """The workload ``config.workload`` describes: a window of a real Azure trace
    (``workload.azure``), a JSONL trace, or a constructed one.

    A trace must say what it is: a header line with ``evidence``, or ``workload.evidence``
    (``real`` / ``constructed`` / ``simulated``); a workload made here is ``constructed``; an
    Azure trace is ``real`` (`real_workload`).

    Raises:
      ValueError / TypeError: a bad setting or trace (the message names the ``workload.`` key).
    """
    evidence = w.get("evidence", "") or None
    if w.get("azure", ""):
        if w.trace:
            raise ValueError(f"workload.azure={w.azure!r} and workload.trace={w.trace!r}: give one")
        if evidence not in (None, "real"):
            raise ValueError(f"workload.evidence={evidence!r}: an Azure trace is 'real'")
        return real_workload(w, max_model_len, time_scale=time_scale)
    if w.trace:
        if not os.path.isfile(w.trace):
            raise ValueError(f"workload.trace={w.trace!r}: no such file")
        wl = Workload.from_jsonl(w.trace, evidence=evidence)
        if any(r.prompt_token_ids is None and r.prompt is None for r in wl.requests):
            wl = wl.with_synthetic_prompts(w.seed)
        wl.check_fits(max_model_len)
        return wl
    if evidence not in (None, "constructed"):
        raise ValueError(f"workload.evidence={evidence!r} labels a trace (workload.trace); a "
                         f"workload made here (workload.kind={w.kind!r}) is 'constructed'")
    try:
        fixed = {k: w.get(k) for k in ("prompt_len", "output_len")} if w.kind == "fixed" else {}
        return make_workload(w.kind, w.num_requests, w.rate, burstiness=w.burstiness,
                             max_model_len=max_model_len, seed=w.seed, **fixed)
    except (ValueError, TypeError) as e:
        raise type(e)(f"workload.{e}") from None


def real_workload(w, max_model_len: int, *, time_scale: bool = True) -> Workload:
    """A window of the Azure trace ``w.azure`` (``evidence: real``) that a small model can serve:
    the arrivals in ``w.window`` (``()`` = all), times ``w.time_scale`` (unless ``time_scale`` is
    False: a sweep scales per point), lengths times ``w.length_scale`` then clipped to
    ``max_model_len``, synthetic prompt ids from ``w.seed`` (a shared system prompt of
    ``w.system_prompt_len`` tokens if > 0, an assumption); every step a derivation in the label.

    Raises:
      ValueError / TypeError: naming the ``workload.`` key.
    """
    window = tuple(w.get("window", ()))
    if window and len(window) != 2:
        raise ValueError(f"workload.window={window!r} must be () or (start_s, end_s)")
    try:
        wl = load_azure_trace(w.azure)
        if window:
            wl = wl.window(*window)
        if time_scale and w.get("time_scale", 1.0) != 1.0:
            wl = wl.time_scaled(w.time_scale)
        wl = wl.scale_lengths(w.get("length_scale", 1.0), max_model_len)
        return wl.with_synthetic_prompts(w.seed, system_prompt_len=w.get("system_prompt_len", 0))
    except (ValueError, TypeError) as e:
        raise type(e)(f"workload (azure={w.azure!r}, window={window}, time_scale="
                      f"{w.get('time_scale')}, length_scale={w.get('length_scale')}): {e}") from None


def engine_config(c, overrides: dict, *, where: str = "engine") -> EngineConfig:
    """``config.engine`` plus an arm's ``overrides`` as an EngineConfig (checked)."""
    return common.make_engine_config(c.engine, model=c.model, where=where, **overrides)


def check_arms(c, by: str = "config.arms") -> list[tuple[str, EngineConfig]]:
    """``(name, EngineConfig)`` per arm of ``config.arms`` (``(name, {field: value})`` pairs)."""
    arms = []
    for i, arm in enumerate(c.arms):
        name, overrides = common.named_pair(arm, f"{by}[{i}]", "engine field")
        arms.append((str(name), overrides))
    if not arms:
        raise ValueError(f"{by}=() names no arm")
    names = [name for name, _ in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"{by}: names {names} must be distinct")
    common.check_unset(c.engine, sorted({k for _, o in arms for k in o}), by)
    return [(name, engine_config(c, o)) for name, o in arms]


def check_serving(c) -> None:
    """The settings every serving study shares: model, SLOs, wall limit."""
    common.check_model(c.model)
    common.check_positive(ttft_slo_ms=c.ttft_slo_ms, tpot_slo_ms=c.tpot_slo_ms)
    if "max_wall_s" in c:
        common.check_positive(max_wall_s=c.max_wall_s)


TABLE_ROWS = (
    ("completed", "completed", "{:.0f}"),
    ("rejected+aborted+timeout", None, "{}"),
    ("request throughput (req/s)", "request_throughput", "{:.2f}"),
    ("output throughput (tok/s)", "output_throughput", "{:.1f}"),
    ("mean TTFT (ms)", "mean_ttft_ms", "{:.0f}"),
    ("p99 TTFT (ms)", "p99_ttft_ms", "{:.0f}"),
    ("mean TPOT (ms)", "mean_tpot_ms", "{:.1f}"),
    ("p99 TPOT (ms)", "p99_tpot_ms", "{:.1f}"),
    ("p99 ITL (ms)", "p99_itl_ms", "{:.1f}"),
    ("p99 E2E (ms)", "p99_e2el_ms", "{:.0f}"),
    ("goodput (req/s in SLO)", "request_goodput", "{:.2f}"),
    ("preemptions", "engine_preemptions", "{}"),
    ("prefix-cache hit tokens", "prefix_cache_hit_tokens", "{}"),
)


def format_line(r: ArmResult) -> str:
    """One arm's result on one line (completed, failures, p99 TTFT / TPOT, goodput)."""
    s = r.summary

    def f(key, spec):
        return "-" if s.get(key) is None else format(s[key], spec)

    return (f"{r.name:20s} {s['completed']}/{s['num_requests']} done "
            f"(rejected+aborted+timeout {s['num_rejected']}+{s['num_aborted']}+{s['num_timeout']})"
            f"  p99 TTFT {f('p99_ttft_ms', '.0f')} ms  p99 TPOT {f('p99_tpot_ms', '.1f')} ms  "
            f"goodput {f('request_goodput', '.2f')} req/s  preemptions {s['engine_preemptions']}")


def format_table(results) -> str:
    width = max(18, *(len(r.name) + 2 for r in results))
    lines = [f"{'':28s}" + "".join(f"{r.name:>{width}s}" for r in results)]
    for label, key, fmt in TABLE_ROWS:
        cells = []
        for r in results:
            s = r.summary
            if key is None:
                v = f"{s['num_rejected']}+{s['num_aborted']}+{s['num_timeout']}"
            else:
                v = "-" if s.get(key) is None else fmt.format(s[key])
            cells.append(f"{v:>{width}s}")
        lines.append(f"{label:28s}" + "".join(cells))
    return "\n".join(lines)
