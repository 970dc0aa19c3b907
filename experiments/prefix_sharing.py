"""KV memory saved by sharing (parallel sampling, shared few-shot prefixes): measured vs ideal.

Each row serves one constructed workload offline with the engine (prefix caching on) and reads the
memory ledger after every step. Units are KV positions (bytes / bytes-per-token); a step counts when
the pool holds any sequence.

**Measured** saving of a step: ``shared_saved_bytes / (bytes needed without sharing)``, where
``shared_saved_bytes = sum over used blocks of (refcount - 1) * filled bytes`` (the ledger) and the
bytes needed without sharing are ``effective_kv + shared + shared_saved_bytes``: every sequence's
filled positions, each stored for itself. Reported as the peak over steps, the mean over steps and
the time-weighted ratio ``sum(saved) / sum(needed)`` over steps. The paper's block-count version,
``sum(refcount - 1) / sum(refcount)`` over used blocks, is reported beside it.

**Ideal** saving: the same ratio when, among the sequences that are resident together, every block
whose content is shared by construction is stored once:

* ``S`` = the workload's common prefix (BOS + system prompt / shots): its full blocks
  ``F(S) = B * floor(S / B)`` are stored once for all resident sequences: ``(r - 1) * F(S)`` saved;
* the ``k`` resident samples of one request (prompt ``p``) also share the rest of their prompt's
  full blocks: ``(k - 1) * (F(p) - F(S))``, and its partial last block (``p mod B`` positions)
  while they still hold exactly ``p`` tokens, i.e. until the first decode write copies it
  (copy-on-write): ``(m - 1) * (p mod B)`` for the ``m`` samples at length ``p``.

Output tokens are never shared, nor are different requests' prompt tokens past ``S`` (random by
construction). Two residencies:

* **ideal (same residency)**: the formula on the sequences the engine holds after each step (their
  lengths and request ids); an exact upper bound of the measured saving of that step;
* **ideal (workload)**: from the workload alone, on an idealised offline timeline: every request
  resident from step 0 with its prompt done and its ``n`` samples forked, one token per step,
  until its last KV write (lengths ``p .. p + output - 2``); peak, mean and time-weighted over
  those steps.

The mean over steps depends on the schedule (staggered admission; samples that wait for a slot keep
sharing their whole prompt), so the headline table compares **time-weighted** ratios: when every
resident sequence steps once per engine step, summing over steps is summing over each request's
life, which is what the workload ideal sums. Peak and mean are reported beside their
same-residency ideals. Evidence: constructed. The headline table has the shape of the PagedAttention
paper's sharing results (rows: parallel sampling n = 2, 4, 6; shared prefix 1-shot, 5-shot).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from pathlib import Path

import numpy as np

from experiments import common
from paged import Engine, EngineConfig, SamplingParams, accounting
from paged.workload.workload import Workload, check_same_evidence, make_workload


# --- ideal -------------------------------------------------------------------------------------
def ideal_saved(groups, block_size: int, common_prefix: int) -> int:
    """Positions saved when shared-by-construction content is stored once (module docstring).

    Args:
      groups: one ``(prompt_len, [held lengths of the request's resident samples])`` per request.
      block_size: ``B``.
      common_prefix: ``S``, leading tokens identical across every request.
    """
    full = lambda x: block_size * (x // block_size)
    resident = sum(len(lens) for _, lens in groups)
    if not resident:
        return 0
    saved = (resident - 1) * full(common_prefix)
    for p, lens in groups:
        saved += (len(lens) - 1) * (full(p) - full(common_prefix))
        at_prompt = sum(1 for n in lens if n == p)
        saved += max(at_prompt - 1, 0) * (p % block_size)
    return saved


def summarize_ratios(saved, needed) -> dict:
    """Peak, mean over steps and time-weighted ratio of per-step saved / needed positions."""
    pairs = [(s, n) for s, n in zip(saved, needed, strict=True) if n > 0]
    if not pairs:
        return {"steps": 0, "peak": None, "mean": None, "time_weighted": None}
    r = [s / n for s, n in pairs]
    return {"steps": len(pairs), "peak": max(r), "mean": float(np.mean(r)),
            "time_weighted": sum(s for s, _ in pairs) / sum(n for _, n in pairs)}


def workload_ideal(workload: Workload, block_size: int) -> dict:
    """The ideal on the idealised offline timeline (module docstring), from the workload alone."""
    reqs = workload.requests
    common_prefix = min(r.shared_prefix_len for r in reqs)
    saved, needed = [], []
    for t in range(max(r.output_len for r in reqs) - 1):
        live = [r for r in reqs if t <= r.output_len - 2]
        groups = [(r.prompt_len, [r.prompt_len + t] * r.n) for r in live]
        saved.append(ideal_saved(groups, block_size, common_prefix))
        needed.append(sum(r.n * (r.prompt_len + t) for r in live))
    return summarize_ratios(saved, needed)


# --- measurement -------------------------------------------------------------------------------
def residency(engine: Engine) -> dict[str, list[int]]:
    """Request id -> KV positions held by each of its device-resident sequences."""
    bm = engine.block_manager
    out: dict[str, list[int]] = collections.defaultdict(list)
    for seq in engine.scheduler.running:
        if bm.has_seq(seq.seq_id) and not bm.is_swapped(seq.seq_id):
            out[seq.request_id].append(bm.num_tokens(seq.seq_id))
    return out


def run_row(engine: Engine, workload: Workload, temperature: float) -> dict:
    """Serves ``workload`` offline on the idle ``engine``; per-step measured and ideal savings."""
    if engine.has_unfinished_requests():
        raise RuntimeError("run_row needs an idle engine")
    bm = engine.block_manager
    bm.evict_cached()  # the previous row's cached blocks must not serve this one
    before = dict(bm.stats())
    preempt0 = engine.scheduler.num_preemptions
    B = engine.page_size
    per_token = engine.kv_stats()["ledger"]["bytes_per_block"] // B
    spec_by_id = {r.request_id: r for r in workload.requests}
    common_prefix = min(r.shared_prefix_len for r in workload.requests)
    for r in workload.requests:
        engine.add_request(r.request_id, r.engine_prompt(), SamplingParams(
            max_tokens=r.output_len, temperature=temperature, n=r.n, ignore_eos=True))
    cols = collections.defaultdict(list)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        ledger = engine.kv_stats()["ledger"]
        cats = ledger["categories"]
        saved = ledger["shared_saved_bytes"] // per_token
        needed = (cats["effective_kv"] + cats["shared"]) // per_token + saved
        usage = bm.block_usage()
        held = residency(engine)
        groups = [(spec_by_id[rid].prompt_len, lens) for rid, lens in held.items()]
        cols["saved"].append(saved)
        cols["needed"].append(needed)
        cols["needed_from_lengths"].append(sum(sum(lens) for lens in held.values()))
        cols["ideal_saved"].append(ideal_saved(groups, B, common_prefix))
        cols["saved_blocks"].append(sum(ref - 1 for ref, _ in usage))
        cols["blocks_without_sharing"].append(sum(ref for ref, _ in usage))
        cols["resident_seqs"].append(sum(len(lens) for lens in held.values()))
        cols["stepped_seqs"].append(engine.last_timing.num_seqs)
    wall = time.perf_counter() - t0
    after = bm.stats()
    violations = sum(s > i for s, i in zip(cols["saved"], cols["ideal_saved"], strict=True))
    mismatch = max((abs(a - b) for a, b in zip(cols["needed"], cols["needed_from_lengths"],
                                                 strict=True)), default=0)
    return {
        "measured": summarize_ratios(cols["saved"], cols["needed"]),
        "measured_blocks": summarize_ratios(cols["saved_blocks"], cols["blocks_without_sharing"]),
        "ideal_same_residency": summarize_ratios(cols["ideal_saved"], cols["needed_from_lengths"]),
        "ideal_workload": workload_ideal(workload, B),
        "checks": {"steps_measured_above_ideal": violations,
                   "max_needed_mismatch_positions": mismatch},
        "engine": {"steps": len(cols["saved"]), "wall_s": wall,
                   "preemptions": engine.scheduler.num_preemptions - preempt0,
                   "cow_copies": after["cow_copies"] - before["cow_copies"],
                   "prefix_cache_hit_tokens": after["hit_tokens"] - before["hit_tokens"],
                   "peak_resident_seqs": max(cols["resident_seqs"], default=0),
                   "steps_with_idle_resident_seqs": sum(
                       r > n for r, n in zip(cols["resident_seqs"], cols["stepped_seqs"],
                                             strict=True)),
                   "num_compilations": engine.num_compilations},
        "trace": {k: list(v) for k, v in cols.items()},
    }


def build_workload(c, overrides: dict) -> Workload:
    w = c.workload
    fixed = w.kind == "fixed"
    wl = make_workload(w.kind, w.num_requests, float("inf"), max_model_len=w.length_context,
                       seed=w.seed, prompt_len=w.prompt_len if fixed else None,
                       output_len=w.output_len if fixed else None, **overrides)
    wl.check_fits(c.engine.max_model_len)
    return wl


def check(c) -> dict:
    """Checks every setting; builds the EngineConfig and every row's workload (no model yet)."""
    common.check_model(c.model)
    if not c.rows:
        raise ValueError("rows=() names no workload")
    if isinstance(c.workload.temperature, bool) or not c.workload.temperature >= 0:
        raise ValueError(f"workload.temperature={c.workload.temperature!r} must be >= 0")
    ecfg = common.make_engine_config(c.engine, model=c.model)
    workloads = []
    for i, row in enumerate(c.rows):
        label, overrides = common.named_pair(row, f"rows[{i}]", "make_workload argument")
        try:
            workloads.append((label, overrides, build_workload(c, overrides)))
        except (ValueError, TypeError) as e:
            raise type(e)(f"rows[{i}] {label!r} with workload.*: {e}") from None
    evidence = check_same_evidence([wl for _, _, wl in workloads])
    return {"engine_config": ecfg, "workloads": workloads, "evidence": evidence}


def run(c, out_dir: Path, plan: dict | None = None) -> dict:
    plan = plan or check(c)
    ecfg, workloads = plan["engine_config"], plan["workloads"]
    model_config, params = common.load_model(c.model)
    engine = Engine(ecfg, model_config=model_config, params=params)
    engine.warmup(logprobs=False, parallel_sampling=False)  # what the old warmup compiled
    spec = accounting.ModelSpec.from_model_config(model_config, dtype=ecfg.dtype)
    rows = []
    bar = common.Progress(len(workloads), "[prefix_sharing]", unit="row")
    for label, overrides, wl in workloads:
        res = run_row(engine, wl, c.workload.temperature)
        bar.update()
        rows.append({"label": label, "overrides": overrides,
                     "common_prefix_len": min(r.shared_prefix_len for r in wl.requests),
                     "workload": {"name": wl.name, "meta": wl.meta, "summary": wl.summary()},
                     **res})
        print(f"{label}: saving {_pct(res['measured']['time_weighted'])}% measured, "
              f"{_pct(res['ideal_workload']['time_weighted'])}% ideal (time-weighted), "
              f"{res['engine']['steps']} steps, "
              f"{res['engine']['wall_s']:.1f} s", flush=True)
    bar.close()
    print(format_table(rows, ecfg))
    payload = {
        "study": "prefix_sharing", "evidence": plan["evidence"], "config": c.to_dict(),
        "engine_config": dataclasses.asdict(ecfg), "model_spec": dataclasses.asdict(spec),
        "definitions": {
            "measured": "per step: ledger shared_saved_bytes / (effective_kv + shared + "
                        "shared_saved_bytes); peak and mean over steps with resident sequences; "
                        "time_weighted = sum(saved) / sum(needed)",
            "measured_blocks": "per step: sum(refcount - 1) / sum(refcount) over used blocks",
            "ideal": "saved positions when shared-by-construction content is stored once: "
                     "(r - 1) * F(S) + sum over requests of (k - 1) * (F(p) - F(S)) + "
                     "(m - 1) * (p mod B); F(x) = B * floor(x / B), S = common prefix (BOS + "
                     "shots), r resident sequences, k resident samples of a request, m of them "
                     "still at prompt length p (before copy-on-write)",
            "ideal_same_residency": "ideal on the sequences the engine holds after each step",
            "ideal_workload": "ideal on an offline timeline: every request resident from step 0, "
                              "prompt done and samples forked, lengths p .. p + output - 2"},
        "rows": rows, "provenance": common.provenance()}
    path = common.write_result(out_dir / "prefix_sharing.json", payload)
    print(f"wrote {path}")
    return payload


# --- report ------------------------------------------------------------------------------------
def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def format_table(rows: list[dict], ecfg: EngineConfig) -> str:
    """The paper-shaped table (time-weighted saving, measured vs ideal), then the details."""
    w = max(24, *(len(r["label"]) + 2 for r in rows))
    lines = [(f"memory saving by sharing (evidence: constructed; B={ecfg.block_size}, offline, "
              "prefix caching on)"),
             "saving = KV positions saved / positions needed without sharing, summed over steps",
             f"{'':{w}s}{'measured %':>12s}{'ideal %':>10s}"]
    for r in rows:
        lines.append(f"{r['label']:{w}s}{_pct(r['measured']['time_weighted']):>12s}"
                     f"{_pct(r['ideal_workload']['time_weighted']):>10s}")
    cols = (("meas mean", "measured", "mean"), ("ideal=res", "ideal_same_residency", "mean"),
            ("ideal wl", "ideal_workload", "mean"), ("meas peak", "measured", "peak"),
            ("ideal=res", "ideal_same_residency", "peak"), ("ideal wl", "ideal_workload", "peak"),
            ("blocks t-w", "measured_blocks", "time_weighted"))
    lines += ["", ("per-step ratios, %: mean and peak over steps (=res: same residency as the "
                   "engine; wl: workload timeline); blocks t-w: sum(refcount-1)/sum(refcount)"),
              f"{'':{w}s}" + "".join(f"{h:>11s}" for h, _, _ in cols)]
    for r in rows:
        lines.append(f"{r['label']:{w}s}" + "".join(f"{_pct(r[k][f]):>11s}" for _, k, f in cols))
    return "\n".join(lines)


def main(c, plan):
    run(c, common.output_dir(c, "prefix_sharing"), plan)


if __name__ == "__main__":
    common.run("prefix_sharing", main, check)
