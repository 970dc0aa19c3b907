"""KV eviction policies on a real model: quality against the KV bytes really held.

Per arm (``config.arms``: "full" or "<method>:<budget>", `experiments/configs/kv_policies.py`),
on SmolLM2-135M through the engine (the policy compacts each prompt's KV when its prefill ends):

* **retrieval**: needle-in-a-haystack exact match (`experiments.quality_tasks`, the quality
  study's task); ``evidence: constructed``;
* **agreement**: the fraction of generated tokens equal to the full-KV arm's, position by
  position up to the first difference (greedy);
* **perplexity and KL against full KV** (``fidelity``): a corpus prefix plays the prompt, the
  policy runs when it ends, and a teacher-forced continuation is scored
  (`experiments.kv_policies_fidelity`: the masked dense reference the engine is tested equal
  to); ``evidence: real``;
* **fleet capacity** (``fleet``): the simulator running the same policy bookkeeping, priced
  (`experiments.kv_policies_fleet`); ``evidence: simulated``;
* **realized KV bytes per sequence**: each needle runs alone; after every step its held bytes
  are read from the engine's ledger (``kv_stats()["ledger"]``: effective KV + tail
  fragmentation + shared), and the row reports the median over the second half of its steps
  (decoding, after the compaction) and the peak (the prefill, before it).

Writes ``kv_policies.json`` and ``kv_policies.png`` (retrieval against realized bytes, the
Pareto front marked).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from experiments import common
from experiments import quality_tasks as tasks

HELD = ("effective_kv", "tail_fragmentation", "shared", "staged")


def parse_arm(text: str):
    """``None`` for "full", else a ``KVPolicyConfig``; ValueError naming the arm."""
    from paged.config.kv_policy import KVPolicyConfig

    if text == "full":
        return None
    method, _, budget = str(text).partition(":")
    try:
        b = float(budget) if "." in budget else int(budget)
        return KVPolicyConfig(method, budget=b)
    except (ValueError, TypeError) as e:
        raise ValueError(f"arm {text!r}: {e}") from None


def check(c) -> list:
    if c.join:
        missing = [d for d in c.join if not (Path(d) / "kv_policies.json").is_file()]
        if missing:
            raise ValueError(f"join={tuple(c.join)}: no kv_policies.json in {missing}")
        missing = [p for p in c.join_capacity if not Path(p).is_file()]
        if missing:
            raise ValueError(f"join_capacity: no such file {missing}")
        return []
    if not c.arms or c.arms[0] != "full":
        raise ValueError(f"arms={c.arms}: the first arm must be 'full' (the reference)")
    return [parse_arm(a) for a in c.arms]


def run_arm(c, policy, config, params, needle_list, max_len):
    """Per needle: (output token ids, answer found, held bytes after each step)."""
    import dataclasses

    from paged import Engine, EngineConfig, SamplingParams

    if policy is not None and policy.method == "streaming_llm":
        policy = dataclasses.replace(policy, sink_tokens=c.sink_tokens)
    engine = Engine(EngineConfig(model=c.model, block_size=c.block_size, max_model_len=max_len,
                                 max_num_seqs=1, max_num_batched_tokens=c.max_num_batched_tokens,
                                 enable_prefix_caching=False, kv_policy=policy),
                    model_config=config, params=params)
    sp = SamplingParams(max_tokens=c.max_tokens, temperature=0.0)
    rows = []
    for i, n in enumerate(needle_list):
        engine.add_request(str(i), n.prompt_ids, sp)
        held, out = [], None
        while engine.has_unfinished_requests():
            for o in engine.step():
                out = o if o.finished else out
            cats = engine.kv_stats()["ledger"]["categories"]
            held.append(sum(cats.get(k, 0) for k in HELD))
        rows.append((out.outputs[0].token_ids, n.answer in out.outputs[0].text, held))
    return rows, engine.kv_stats()


def agreement(ref: list[int], got: list[int]) -> float:
    same = 0
    for a, b in zip(ref, got):
        if a != b:
            break
        same += 1
    return same / max(len(ref), 1)


def join(c) -> None:
    """The pieces' rows in one table and one plot (`experiments.kv_policies_board`)."""
    from experiments import kv_policies_board as board

    out_dir = common.output_dir(c, "kv_policies")
    rows, pieces = board.load_pieces(c.join)
    cap = board.engine_capacity(c.join_capacity)
    inputs = [p["path"] for p in pieces] + list(c.join_capacity)
    text = board.table(rows) + ("\n\n" + board.capacity_table(cap) if cap else "")
    (out_dir / "board.md").write_text(text + "\n")
    common.write_result(out_dir / "board.json", {
        "study": "kv_policies", "joined": pieces, "config": c.to_dict(),
        "evidence": {"retrieval": "constructed", "kv_bytes": "constructed", "fidelity": "real",
                     "fleet": "simulated", **({"engine_capacity": "constructed"} if cap else {})},
        "rows": rows, "engine_capacity": cap}, inputs=inputs)
    board.plot(rows, out_dir / "board.png")
    print(text)
    print(f"wrote {out_dir}/board.json, board.md, board.png")


def main(c, policies: list) -> None:
    from paged.models.registry import load_any

    if c.join:
        return join(c)
    out_dir = common.output_dir(c, "kv_policies")
    t0 = time.perf_counter()
    config, params, tok = load_any(c.model)
    corpus = tok.encode(tasks.corpus_text(), add_bos=False)
    needle_list = [n for length in c.needle_lengths for d in c.needle_depths
                   for n in tasks.needles(tok, corpus, length, d, c.needles_per_cell, c.seed)]
    max_len = max(len(n.prompt_ids) for n in needle_list) + c.max_tokens + c.block_size
    max_len = -(-max_len // c.block_size) * c.block_size
    from experiments import kv_policies_fidelity as fid
    from experiments import kv_policies_fleet as fleet

    fid_chunks = fid.chunks(c, corpus)
    fid_run = fid.jit_pass(config, params)
    fid_ref, fleets = None, {}
    rows, ref = [], None
    with common.Progress(len(policies), "kv_policies", unit="arms") as bar:
        for name, policy in zip(c.arms, policies, strict=True):
            t = time.perf_counter()
            per, stats = run_arm(c, policy, config, params, needle_list, max_len)
            got = [fid.continuation_logprobs(config, params, fid_run, ch, policy,
                                             c.fidelity_prefix) for ch in fid_chunks]
            fid_ref = got if fid_ref is None else fid_ref
            fidelity = fid.score(fid_ref, got, fid_chunks, c.fidelity_prefix)
            k = fleet.key(policy)
            if c.fleet.enabled and k not in fleets:
                fleets[k] = {**fleet.capacity(c.fleet, policy), "key": repr(k)}
            ref = per if ref is None else ref
            # The decode phase: the second half of the steps (24 decodes against a few prefill
            # chunks), the policy's call behind it.
            decode_held = [np.median(h[len(h) // 2:]) for _, _, h in per]
            row = {"arm": name, "method": "full" if policy is None else policy.method,
                   "budget": None if policy is None else policy.budget,
                   "retrieval": float(np.mean([ok for _, ok, _ in per])),
                   "agreement": float(np.mean([agreement(r[0], p[0])
                                               for r, p in zip(ref, per, strict=True)])),
                   "kv_bytes_decode_mean": float(np.mean(decode_held)),
                   "kv_bytes_peak": float(np.mean([max(h) for _, _, h in per])),
                   "kv_policy": stats["kv_policy"],
                   "evicted_bytes": stats["ledger"]["evicted_bytes"],
                   "fidelity": fidelity, "fleet": fleets.get(k),
                   "seconds": time.perf_counter() - t}
            rows.append(row)
            cap = (row["fleet"] or {}).get("capacity_rps")
            print(f"{name:<20} retrieval {row['retrieval']:.2f} agreement "
                  f"{row['agreement']:.2f} KV/seq {row['kv_bytes_decode_mean'] / 1e6:.2f} MB "
                  f"(peak {row['kv_bytes_peak'] / 1e6:.2f} MB) ppl {fidelity['perplexity']:.2f} "
                  f"KL {fidelity['kl_mean']:.3f} fleet {cap} req/s", flush=True)
            bar.update()
    pareto = pareto_front(rows)
    for r in rows:
        r["pareto"] = r["arm"] in pareto
    payload = {"study": "kv_policies", "model": c.model, "config": c.to_dict(),
               "provenance": common.provenance(),
               "evidence": {"retrieval": "constructed", "kv_bytes": "constructed",
                            "fidelity": "real", "fleet": "simulated"},
               "fidelity": {"corpus": tasks.corpus_info(tasks.corpus_text(), len(corpus)),
                            "prefix": c.fidelity_prefix,
                            "continuation": c.fidelity_continuation,
                            "chunks": c.fidelity_chunks},
               "needle": {"prompt_tokens": sorted({len(n.prompt_ids) for n in needle_list})},
               "rows": rows, "seconds": time.perf_counter() - t0}
    path = common.write_json(out_dir / "kv_policies.json", payload)
    plot(rows, out_dir / "kv_policies.png")
    print(f"wrote {path}")


def pareto_front(rows) -> set:
    """Arms no other arm beats on both retrieval (higher) and decode KV bytes (lower)."""
    front = set()
    for r in rows:
        if not any(o["retrieval"] >= r["retrieval"] and o["kv_bytes_decode_mean"]
                   <= r["kv_bytes_decode_mean"] and (o["retrieval"], o["kv_bytes_decode_mean"])
                   != (r["retrieval"], r["kv_bytes_decode_mean"]) for o in rows):
            front.add(r["arm"])
    return front


def plot(rows, path) -> None:
    from experiments.plots import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        x = r["kv_bytes_decode_mean"] / 1e6
        ax.scatter(x, r["retrieval"], marker="*" if r["pareto"] else "o", s=80)
        ax.annotate(r["arm"], (x, r["retrieval"]), fontsize=7)
    ax.set_xlabel("KV bytes per sequence while decoding (MB, ledger)")
    ax.set_ylabel("retrieval exact match")
    ax.set_title("KV policies: quality vs realized bytes (* Pareto)")
    save(fig, path)


if __name__ == "__main__":
    common.run("kv_policies", main, check)
