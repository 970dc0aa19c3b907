"""The router on KV events: prefix-aware routing over the replicas' KV event streams against the
same routing asking the replicas' caches directly, on the same trace window and replicas.

Evidence: ``measured`` on CPU engines (``random-small``) serving a ``real`` workload: a window of
a Mooncake trace, prompts shrunk to ``block`` tokens per trace block (a recorded derivation),
arrivals compressed by ``time_scale``. The replicas are stepped in-process on one clock that
advances by the slowest replica's measured step (the devices run side by side); arrivals are
routed against it by ``paged.fleet.routing.Router("prefix_aware")``, the routing core of the
HTTP router (`paged.router.app.RouterApp.pick`), seeing each replica through:

* ``direct``: the replica's own prefix cache (``paged.fleet.routing.EngineReplica``), the
  in-process router's view;
* ``events``: a ``paged.router.backends.Backend`` subscribed to the replica's KV events
  (``paged.server.kv_publisher`` over ZeroMQ, one batch per step, as the server publishes;
  ``paged.router.kv_subscriber`` rebuilds the view), the HTTP router's ``--kv_events`` path;
* ``least_loaded``: no cache signal (the floor).

Loads are the replicas' waiting + running in every arm, read at routing time (a scrape that is
never stale), so the arms differ only in the cache view. Per arm: the fleet's prefix hit rate
(prompt tokens served from the replicas' caches / prompt tokens), and for ``events`` how often the
view's hit for the routed prompt equalled the replica's true one at routing time. The goal:
``events`` >= 95 % of ``direct``. Writes ``router_events.json`` and ``router_events.md``.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time

from experiments import common
from experiments.cache_agreement import window_setup
from paged import Engine, SamplingParams
from paged.fleet.routing import EngineReplica, Router
from paged.workload import mooncake_trace

STUDY = "router_events"
ARMS = ("direct", "events", "least_loaded")


def check(c) -> dict:
    bad = [a for a in c.arms if a not in ARMS]
    if bad or not c.arms:
        raise ValueError(f"arms={tuple(c.arms)!r}: unknown {bad}; known: {ARMS}")
    if c.trace not in mooncake_trace.TRACES:
        raise ValueError(f"trace={c.trace!r}; known: {tuple(mooncake_trace.TRACES)}")
    if type(c.num_replicas) is not int or c.num_replicas < 2:
        raise ValueError(f"num_replicas={c.num_replicas!r} must be an int >= 2")
    common.check_positive(time_scale=c.time_scale, pool_fraction=c.pool_fraction)
    base = common.make_engine_config(c.engine, model=c.model)
    if base.block_size != c.block:
        raise ValueError(f"engine.block_size={base.block_size} must equal block={c.block}")
    w = mooncake_trace.load_mooncake_trace(c.trace, window=tuple(c.window), block=c.block)
    w.check_fits(base.max_model_len)
    return {"base": base, "workload": w.time_scaled(c.time_scale)}


def _free_base_port() -> int:
    """A port whose successor is free too (a replica's publisher binds two)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
            return p
    raise RuntimeError("no two consecutive free ports")


def run_arm(arm: str, cfg, model, w, c) -> dict:
    from paged.router.backends import Backend
    from paged.server.kv_publisher import attach_publishers

    engines = [Engine(cfg, model_config=model[0], params=model[1]) for _ in range(c.num_replicas)]
    for e in engines:
        e.warmup(logprobs=False, parallel_sampling=False)
    pubs, views = [], [EngineReplica(e) for e in engines]
    if arm == "events":
        ports = [_free_base_port() for _ in engines]
        pubs = [attach_publishers(e, p) for e, p in zip(engines, ports)]
        views = [Backend(f"http://replica{i}", kv_events=f"tcp://127.0.0.1:{p}")
                 for i, p in enumerate(ports)]
        time.sleep(0.3)  # the subscriptions connect (a late start would be replayed anyway)
    router = Router("least_loaded" if arm == "least_loaded" else "prefix_aware",
                    load_threshold=c.load_threshold)
    specs = sorted(w.requests, key=lambda r: r.arrival_s)
    clock, i, steps, exact, probed = 0.0, 0, 0, 0, 0
    counts = [0] * len(engines)
    t0 = time.perf_counter()
    try:
        while i < len(specs) or any(e.has_unfinished_requests() for e in engines):
            if not any(e.has_unfinished_requests() for e in engines):
                clock = max(clock, specs[i].arrival_s)
            while i < len(specs) and specs[i].arrival_s <= clock:
                r = specs[i]
                ids = list(r.engine_prompt())
                if arm == "events":
                    for v, e in zip(views, engines):  # what a scrape would say, never stale
                        v.events.poll(2)
                        v.scraped_waiting = e.core.num_waiting
                        v.scraped_running = e.core.num_running
                j = router.route(ids, views)
                if arm == "events":
                    probed += 1
                    exact += views[j].cached_prefix_tokens(ids) == \
                        engines[j].block_manager.cached_prefix_tokens(ids)
                counts[j] += 1
                engines[j].add_request(r.request_id, ids, SamplingParams(
                    max_tokens=r.output_len, temperature=0.0, ignore_eos=True),
                    arrival_time=r.arrival_s)
                i += 1
            longest = 0.0
            for k, e in enumerate(engines):
                if e.has_unfinished_requests():
                    n, t = e.num_steps, time.perf_counter()
                    e.step()
                    longest = max(longest, time.perf_counter() - t)
                    steps += e.num_steps - n
                    if pubs:
                        pubs[k].flush()  # one batch of events per step, as the server publishes
            clock += longest
        stats = [e.kv_stats() for e in engines]
    finally:
        for p in pubs:
            p.close()
        for v in views:
            if getattr(v, "events", None) is not None:
                v.events.close()
    hit = sum(s["prefix_cache_hit_tokens"] for s in stats)
    prompt = sum(r.prompt_len for r in w.requests)
    out = {"arm": arm, "prefix_hit_rate": hit / prompt, "prefix_cache_hit_tokens": hit,
           "prompt_tokens": prompt, "requests_per_replica": counts, "steps": steps,
           "span_s": clock, "wall_s": time.perf_counter() - t0,
           "preemptions": sum(s["num_preemptions"] for s in stats),
           "route_kinds": dict(router.num_routed)}
    if arm == "events":
        out["view_exact_at_routing"] = exact / probed if probed else None
        out["event_batches_lost"] = sum(int(bool(v.events.stream.lost)) for v in views)
    return out


def main(c, plan):
    out_dir = common.output_dir(c, STUDY)
    w, distinct, model, num_blocks = window_setup(c, plan)
    cfg = dataclasses.replace(plan["base"], num_blocks=num_blocks)
    print(f"{c.trace} {tuple(c.window)} s x{c.time_scale:g}: {len(w)} requests, {distinct} "
          f"distinct prompt blocks, {c.num_replicas} replicas of {num_blocks - 1} blocks",
          flush=True)
    rows = []
    for arm in c.arms:
        r = run_arm(arm, cfg, model, w, c)
        rows.append(r)
        print(f"  {arm:12s} prefix hit {r['prefix_hit_rate']:.2%} per replica "
              f"{r['requests_per_replica']} [{r['wall_s']:.0f} s]", flush=True)
    by = {r["arm"]: r for r in rows}
    ratio = (by["events"]["prefix_hit_rate"] / by["direct"]["prefix_hit_rate"]
             if "events" in by and "direct" in by and by["direct"]["prefix_hit_rate"] else None)
    table = markdown(rows, ratio)
    (out_dir / f"{STUDY}.md").write_text(table + "\n")
    print(table)
    path = common.write_result(out_dir / f"{STUDY}.json", {
        "study": STUDY, "evidence": "real", "workload": {
            "label": w.label(), "evidence": w.evidence, "requests": len(w),
            "distinct_prompt_blocks": distinct, "pool_blocks_per_replica": num_blocks - 1,
            "meta": {k: v for k, v in w.meta.items() if k != "derived"},
            "derived": w.meta["derived"]},
        "rows": rows, "events_over_direct": ratio, "config": c.to_dict(),
        "provenance": {**common.provenance(), "load_average": list(os.getloadavg())}})
    print(f"wrote {path}")


def markdown(rows, ratio) -> str:
    lines = ["| arm | prefix hit rate | requests per replica | view exact at routing | "
             "preemptions |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        ex = r.get("view_exact_at_routing")
        lines.append(f"| {r['arm']} | {r['prefix_hit_rate']:.2%} | {r['requests_per_replica']} "
                     f"| {'-' if ex is None else f'{ex:.1%}'} | {r['preemptions']} |")
    if ratio is not None:
        lines.append(f"\nevents / direct prefix hit rate: {ratio:.1%} (goal >= 95 %)")
    return "\n".join(lines)


if __name__ == "__main__":
    common.run(STUDY, main, check)
