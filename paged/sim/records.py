"""A simulated request's ``RequestRecord``: from its final output, or for one never admitted.

Shared by the colocated loop (``paged.sim.simulator``) and the disaggregated one
(``paged.sim.disagg``). Every simulated result is labelled ``evidence: "simulated"``.
"""

from __future__ import annotations

from paged.workload import metrics

EVIDENCE = "simulated"
STATUS = {"stop": "finished", "length": "finished", "abort": "aborted", "timeout": "timeout"}


def record_of(out, prompt_len: int) -> metrics.RequestRecord:
    """A finished request's ``RequestOutput`` as a ``RequestRecord`` (simulated times)."""
    status = STATUS.get(out.finish_reason, "aborted")
    times = out.token_times  # (the record keeps them as a tuple)
    # A finished request's record holds one time per output token (``RequestRecord`` checks
    # it), so their count is its output length without building the outputs' token lists.
    n = len(times) if times and status == "finished" else len(out.token_ids)
    return metrics.RequestRecord(
        request_id=out.request_id, status=status, arrival_s=out.arrival_time,
        first_scheduled_s=out.first_scheduled_time, first_token_s=out.first_token_time,
        finish_s=out.finish_time, token_times=times, prompt_len=prompt_len, output_len=n,
        num_preemptions=out.num_preemptions, num_cached_tokens=out.num_cached_tokens)


def rejected_record(spec, now: float) -> metrics.RequestRecord:
    return metrics.RequestRecord(
        request_id=spec.request_id, status="rejected", arrival_s=spec.arrival_s,
        first_scheduled_s=None, first_token_s=None, finish_s=None, token_times=(),
        prompt_len=spec.prompt_len, output_len=0)


def close_records(reps, records: dict, specs, now: float) -> list:
    """The end of a run at ``now``: what is unfinished on ``reps`` is aborted (a step in flight
    dropped), what never arrived is rejected; returns the records in workload order."""
    spec_of = {s.request_id: s for s in specs}
    for rep in reps:
        if rep.in_step:
            rep.drop_step()
        for rid in rep.unfinished_request_ids():
            if rid not in records:
                rep.abort(rid, now)
        for out in rep.report_aborts():
            if out.finished:
                records[out.request_id] = record_of(out, spec_of[out.request_id].prompt_len)
    for spec in specs:
        if spec.request_id not in records:
            records[spec.request_id] = rejected_record(spec, max(now, spec.arrival_s))
    return [records[s.request_id] for s in specs]


def fleet_summary(recs: list, reps, workload, ttft_slo_ms, tpot_slo_ms) -> tuple[dict, list, int]:
    """``paged.workload.metrics.summarize`` of a run's records plus the fleet's counters; returns
    (summary, each replica's ``stats()``, steps over all replicas)."""
    first = recs[0].arrival_s if recs else 0.0
    last = max([r.finish_s for r in recs if r.finish_s is not None], default=first)
    summary = metrics.summarize(recs, duration_s=max(last - first, 1e-9),
                                ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms,
                                evidence=EVIDENCE)
    stats = [rep.stats() for rep in reps]
    steps = sum(s["num_steps"] for s in stats)
    summary.update(
        num_engine_steps=steps, engine_preemptions=sum(s["num_preemptions"] for s in stats),
        prefix_cache_hit_tokens=sum(s["prefix_cache_hit_tokens"] for s in stats),
        peak_used_blocks=max(s["peak_used_blocks"] for s in stats),
        max_blocks_per_sequence=max(s["max_blocks_per_sequence"] for s in stats),
        recycled_blocks=sum(s["recycled_blocks"] for s in stats),
        cascade_steps=sum(s["cascade_steps"] for s in stats),
        cascade_prefix_tokens_shared=sum(s["cascade_prefix_tokens_shared"] for s in stats),
        kv_block_size=stats[0]["block_size"], kv_num_blocks=stats[0]["num_blocks"],
        num_replicas=len(reps), workload_evidence=workload.evidence)
    tiers = [s["host_tier"] for s in stats if "host_tier" in s]
    if tiers:  # a host KV tier (``paged.sim.host_link``): its hits and copies over the fleet
        summary.update({f"host_tier_{k}": sum(t[k] for t in tiers) for k in (
            "hit_tokens", "loaded_blocks", "offloaded_blocks", "load_s", "offload_s",
            "load_wait_s", "copy_only_steps", "offload_bound_steps", "num_loads")})
    return summary, stats, steps


__all__ = ["EVIDENCE", "STATUS", "close_records", "fleet_summary", "record_of", "rejected_record"]
