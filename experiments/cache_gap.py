"""Why online prefix-cache eviction falls short of Belady's MIN on the Mooncake traces: an
offline replay of the traces' block chains (no simulator, no timing), in arrival order.

Evidence: ``real`` (the trace files; nothing simulated). Each request looks up its chain of
512-token blocks (every full block; the block of the final token is not looked up, as
admission does) and hits until its first miss; the rest are computed and cached; its blocks are
released tail first when it ends, before the next request (one request at a time: no running
request holds pool space, so the pool is all cache, as MIN assumes). The replay drives the real
eviction orders (`paged.kv.blocks.eviction`) through a minimal pool. Per case and pool size:

* ``min``: Belady's MIN on the same chains (`paged.kv.blocks.belady`);
* each policy's hit rate and its fraction of MIN;
* ``oracle_lru``: LRU that puts every block that is never looked up again at the victim end
  when released (it knows the future, but only whether a block comes back, not when): how much
  of the gap is the one-hit blocks;
* the reuse structure: the share of distinct blocks looked up once (one-hit wonders), the reuse
  distance (accesses between two looks at a block) quantiles, and the probability that a newly
  computed block is looked up again, by how many leading blocks its request hit.

Writes ``cache_gap.json`` and ``cache_gap.md``.
"""

from __future__ import annotations

import collections
import os
import time
from collections import OrderedDict

import numpy as np

from experiments import common
from paged.config.eviction import parse_eviction
from paged.kv.blocks.belady import belady
from paged.kv.blocks.eviction import make_order
from paged.workload import mooncake_trace

STUDY = "cache_gap"
BLOCK = mooncake_trace.BLOCK_TOKENS


def check(c) -> None:
    for p in c.policies:
        name, _ = parse_eviction(p)
        if name in ("cost", "tail_first", "waiting", "priority"):
            raise ValueError(f"policy {p!r} needs the engine's index or queue; the replay runs "
                             "lru, lfu, slru, arc")
    for case in c.cases:
        if len(case) != 3 or case[0] not in mooncake_trace.TRACES:
            raise ValueError(f"cases: {case!r} must be (trace, start_s, end_s), trace one of "
                             f"{tuple(mooncake_trace.TRACES)}")
    if not c.pool_fractions or any(not 0 < f <= 1 for f in c.pool_fractions):
        raise ValueError(f"pool_fractions={tuple(c.pool_fractions)!r} must be in (0, 1]")


def chains(trace: str, start: float, end: float) -> list[list]:
    """Each request's looked-up block keys (a key is its whole prefix: chained), arrival order."""
    rows = mooncake_trace.read(trace)
    out = []
    for t, n_tokens, ids in zip(rows.arrival_s, rows.input_lens, rows.hash_ids):
        if t < start or (end > 0 and t >= end):
            continue
        keys, prev = [], None
        for h in ids[:(n_tokens - 1) // BLOCK]:
            prev = (prev, h)
            keys.append(hash(prev))
        out.append(keys)
    return out


def replay(reqs, cap: int, order) -> float:
    """Block hit rate of ``reqs`` through a pool of ``cap`` blocks ordered by ``order``."""
    on_take, on_hit = order.on_take, order.on_hit
    free, where, key_of = list(range(cap)), {}, [None] * cap
    hits = looked = 0
    for ch in reqs:
        looked += len(ch)
        h = 0
        for k in ch:
            b = where.get(k)
            if b is None:
                break
            h += 1
            if b in order:
                del order[b]
            if on_hit is not None:
                on_hit(b)
        hits += h
        new = []
        for k in ch[h:]:
            if k in where:  # cached behind a miss: its old copy goes (recomputed anyway)
                old = where.pop(k)
                del order[old]
                free.append(old)
            if free:
                b = free.pop()
            else:
                b, _ = order.evict_one()
                del where[key_of[b]]
            where[k], key_of[b] = b, k
            new.append(b)
        if on_take is not None:
            on_take(new)
        for b in reversed([where[k] for k in ch]):  # released tail first
            order[b] = key_of[b]
    return hits / looked if looked else 0.0


def oracle_lru(reqs, cap: int) -> float:
    """LRU that releases a block never looked up again at the victim end (module docstring)."""
    last = {}
    for i, ch in enumerate(reqs):
        for k in ch:
            last[k] = i
    lru: OrderedDict = OrderedDict()
    hits = looked = 0
    for i, ch in enumerate(reqs):
        looked += len(ch)
        h = 0
        for k in ch:
            if k not in lru:
                break
            h += 1
        hits += h
        for k in ch:
            lru.pop(k, None)
        while len(lru) > cap - len(ch):
            lru.popitem(last=False)
        for k in reversed(ch):
            lru[k] = None
            if last[k] == i:
                lru.move_to_end(k, last=False)
    return hits / looked if looked else 0.0


def structure(reqs) -> dict:
    """One-hit share, reuse distances, and reuse probability of new blocks by their request's hit."""
    count = collections.Counter(k for ch in reqs for k in ch)
    seen, first_hit, last, dists, t = set(), {}, {}, [], 0
    for ch in reqs:
        h = 0
        for k in ch:
            if k not in seen:
                break
            h += 1
        cls = "0" if h == 0 else "1" if h == 1 else "2-8" if h <= 8 else ">8"
        for k in ch[h:]:
            if k not in seen:
                first_hit[k] = cls
        for k in ch:
            if k in last:
                dists.append(t - last[k])
            last[k] = t
            t += 1
        seen.update(ch)
    by = collections.defaultdict(lambda: [0, 0])
    for k, cls in first_hit.items():
        by[cls][0] += 1
        by[cls][1] += count[k] > 1
    q = np.percentile(dists, [10, 25, 50, 75, 90]).tolist() if dists else []
    return {"requests": len(reqs), "accesses": t, "distinct": len(count),
            "one_hit_share": sum(v == 1 for v in count.values()) / max(1, len(count)),
            "infinite_cache_hit_rate": 1 - len(count) / max(1, t),
            "reuse_distance_quantiles": dict(zip(("p10", "p25", "p50", "p75", "p90"), q)),
            "new_block_reuse_by_request_hit": {
                c: {"new_blocks": n, "reused": r / n} for c, (n, r) in sorted(by.items())}}


def main(c, plan):
    out_dir = common.output_dir(c, STUDY)
    rows, cases = [], []
    for trace, start, end in c.cases:
        reqs = chains(trace, start, end)
        st = structure(reqs)
        name = f"{trace} {start:g}-{end:g} s" if end > 0 else f"{trace} (whole)"
        cases.append({"case": name, **st})
        print(f"{name}: {st['requests']} requests, {st['distinct']} distinct blocks, one-hit "
              f"{st['one_hit_share']:.1%}, infinite {st['infinite_cache_hit_rate']:.1%}",
              flush=True)
        for frac in c.pool_fractions:
            cap = max(int(frac * st["distinct"]), max(map(len, reqs)))
            t = time.perf_counter()
            m = belady(reqs, cap)["block_hit_rate"]
            r = {"case": name, "pool_fraction": frac, "pool_blocks": cap, "min": m,
                 "oracle_lru": oracle_lru(reqs, cap)}
            for p in c.policies:
                r[p] = replay(reqs, cap, make_order(p, cap, None, BLOCK))
            r["wall_s"] = time.perf_counter() - t
            rows.append(r)
            print("  " + line(r, c.policies), flush=True)
    table = markdown(rows, cases, c.policies)
    (out_dir / f"{STUDY}.md").write_text(table + "\n")
    print(table)
    path = common.write_result(out_dir / f"{STUDY}.json", {
        "study": STUDY, "evidence": "real", "cases": cases, "rows": rows,
        "config": c.to_dict(),
        "provenance": {**common.provenance(), "load_average": list(os.getloadavg())}})
    print(f"wrote {path}")


def line(r, policies) -> str:
    m = r["min"]
    parts = [f"{p} {r[p]:.1%} ({r[p] / m:.0%})" for p in (*policies, "oracle_lru")]
    return f"pool {r['pool_fraction']:g} ({r['pool_blocks']}): MIN {m:.1%}; " + ", ".join(parts)


def markdown(rows, cases, policies) -> str:
    cols = (*policies, "oracle_lru")
    lines = ["| case | pool (blocks) | MIN | " + " | ".join(cols) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in cols) + " |"]
    for r in rows:
        m = r["min"]
        lines.append(f"| {r['case']} | {r['pool_fraction']:g} ({r['pool_blocks']}) | {m:.1%} | "
                     + " | ".join(f"{r[p]:.1%} ({r[p] / m:.0%})" for p in cols) + " |")
    lines += ["", "| case | distinct blocks | one-hit share | infinite-cache hit | reuse distance "
              "p25 / p50 / p75 (accesses) | new blocks reused, by their request's hit blocks |",
              "| --- | --- | --- | --- | --- | --- |"]
    for s in cases:
        q = s["reuse_distance_quantiles"]
        by = ", ".join(f"{k}: {v['reused']:.0%} of {v['new_blocks']}"
                       for k, v in s["new_block_reuse_by_request_hit"].items())
        lines.append(f"| {s['case']} | {s['distinct']} | {s['one_hit_share']:.1%} | "
                     f"{s['infinite_cache_hit_rate']:.1%} | {q.get('p25', 0):.0f} / "
                     f"{q.get('p50', 0):.0f} / {q.get('p75', 0):.0f} | {by} |")
    return "\n".join(lines)


if __name__ == "__main__":
    common.run(STUDY, main, check)
