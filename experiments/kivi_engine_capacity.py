"""Tokens held at equal KV bytes, measured from the engine: int4 / int2 KIVI pages (packed pool
plus one open page per running sequence in the model dtype) against bfloat16 and int8.

Every format gets the same KV budget: ``budget_seqs`` bfloat16 sequences of ``seq_len`` tokens
plus the null page. An engine's KV bytes are what it allocates: ``cache.nbytes`` (the pool, null
page included) plus ``cache.open_nbytes`` (int4 / int2: ``max_num_seqs`` open pages). For
bfloat16 and int8 the whole budget is pool pages; for int4 / int2 ``max_num_seqs`` is sized by
the accounting (``ModelSpec.sequences_for_bytes``: how many running sequences the budget holds,
each its pool blocks plus its open page) and the rest of the budget is pool pages. Then the
engine serves two more distinct sequences than fit (random prompts of ``seq_len - generated``
tokens, ``generated`` greedy tokens: long enough that every prompt is admitted before the first
sequence finishes; prefix caching off) and the study records, after every step, the tokens held
in the pool (``kv_stats`` ledger: filled positions of in-use blocks) and the running sequences;
**tokens held** is the peak (the pool full: the next page a sequence needs preempts another). Evidence: constructed (random weights and
prompts; capacity does not depend on them). A model of one layer and one KV head with the
configured head dim: every format's bytes scale with layers x KV heads alike.

Writes ``kivi_engine_capacity.json``.
"""

from __future__ import annotations

import time

import numpy as np

from experiments import common
from paged.accounting.formulas import ModelSpec


def check(c) -> dict:
    common.check_positive(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                          head_dim=c.head_dim, seq_len=c.seq_len, generated=c.generated,
                          budget_seqs=c.budget_seqs,
                          max_num_batched_tokens=c.max_num_batched_tokens,
                          **{f"page_sizes[{i}]": p for i, p in enumerate(c.page_sizes)})
    if "auto" not in c.formats:
        raise ValueError(f"formats={c.formats} must hold 'auto' (the baseline)")
    if c.generated >= c.seq_len:
        raise ValueError(f"generated={c.generated} must be < seq_len={c.seq_len}")
    specs = {f: ModelSpec(c.num_layers, c.num_kv_heads, c.head_dim, c.dtype, kv_cache_dtype=f)
             for f in c.formats}  # refuses an unknown format
    return {"specs": specs}


def _model(c):
    from paged.models.config import LlamaConfig
    from paged.models.registry import init_params

    cfg = LlamaConfig(vocab_size=258, d_model=64, num_layers=c.num_layers, num_heads=2 * c.num_kv_heads,
                      num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, ffn_dim=64,
                      max_seq_len=c.seq_len + 64, dtype=c.dtype)
    return cfg, init_params(cfg, c.seed)


def sizing(spec: ModelSpec, page: int, c, budget: int) -> tuple[int, int]:
    """``(num_blocks, max_num_seqs)`` of a format within ``budget`` bytes."""
    if spec.packed_bits is None:
        return budget // spec.bytes_per_block(page), 64
    seqs = spec.sequences_for_bytes(budget - spec.bytes_per_block(page), c.seq_len, page)
    return (budget - seqs * spec.open_page_bytes(page)) // spec.bytes_per_block(page), seqs


def run_one(c, fmt: str, spec: ModelSpec, page: int, budget: int, model) -> dict:
    from paged import Engine, EngineConfig, SamplingParams

    num_blocks, max_seqs = sizing(spec, page, c, budget)
    config = EngineConfig(block_size=page, num_blocks=num_blocks, max_num_seqs=max_seqs,
                          max_num_batched_tokens=c.max_num_batched_tokens,
                          max_model_len=c.seq_len, kv_cache_dtype=fmt, dtype=c.dtype,
                          enable_prefix_caching=False, attention_impl="xla", seed=c.seed)
    engine = Engine(config, model_config=model[0], params=model[1])
    kv_bytes = engine.cache.nbytes + engine.cache.open_nbytes
    assert kv_bytes <= budget, (fmt, kv_bytes, budget)
    rng = np.random.default_rng(c.seed)
    n_req = spec.sequences_for_bytes(budget, c.seq_len, page) + 2  # more than fit
    sp = SamplingParams(max_tokens=c.generated, temperature=0.0, ignore_eos=True)
    for i in range(n_req):
        engine.add_request(f"r{i}", rng.integers(0, 256, c.seq_len - c.generated).tolist(), sp)
    per_token = spec.value_bytes_per_block(page) // page
    peak = dict(tokens=0, running=0)
    t0, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        s = engine.kv_stats()
        cat = s["ledger"]["categories"]
        held = (cat["effective_kv"] + cat["shared"] + cat["staged"]) // per_token
        if held > peak["tokens"]:
            peak = dict(tokens=int(held), running=s["num_running"])
    s = engine.kv_stats()
    return {"format": fmt, "page_size": page, "num_blocks": num_blocks, "max_num_seqs": max_seqs,
            "kv_bytes": kv_bytes, "pool_bytes": engine.cache.nbytes,
            "open_page_bytes": engine.cache.open_nbytes, "requests": n_req,
            "tokens_held": peak["tokens"], "running_at_peak": peak["running"],
            "sequences_at_peak": peak["tokens"] / c.seq_len,
            "num_preemptions": s["num_preemptions"], "steps": steps,
            "seconds": time.perf_counter() - t0,
            "formula_tokens": spec.sequences_for_bytes(budget - spec.bytes_per_block(page),
                                                       c.seq_len, page) * c.seq_len}


def main(c, plan) -> None:
    model = _model(c)
    specs = plan["specs"]
    rows = []
    for page in c.page_sizes:
        budget = c.budget_seqs * specs["auto"].sequence_bytes(c.seq_len, page) \
            + specs["auto"].bytes_per_block(page)
        base = None
        for fmt in c.formats:
            r = run_one(c, fmt, specs[fmt], page, budget, model)
            r["budget_bytes"] = budget
            base = r["tokens_held"] if fmt == "auto" else base
            r["tokens_over_model_dtype"] = r["tokens_held"] / base
            rows.append(r)
            print(f"page {page:3d} {fmt:5s} blocks {r['num_blocks']:5d} seqs {r['max_num_seqs']:3d} "
                  f"KV {r['kv_bytes']:>10,d} B  tokens held {r['tokens_held']:>7,d} "
                  f"(running {r['running_at_peak']}) x{r['tokens_over_model_dtype']:.3f} "
                  f"formula {r['formula_tokens']:,d}  {r['seconds']:.0f} s", flush=True)
    payload = {"study": "kivi_engine_capacity", "evidence": "constructed", "config": c.to_dict(),
               "rows": rows, "provenance": common.provenance()}
    path = common.write_result(
        common.output_dir(c, "kivi_engine_capacity") / "kivi_engine_capacity.json", payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    common.run("kivi_engine_capacity", main, check)
