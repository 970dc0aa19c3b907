"""Tokens held at equal KV bytes: int4 / int2 KIVI pages against the model dtype and int8.

Per (model, page size, sequence length, format): the bytes of one pool block
(`ModelSpec.bytes_per_block`: packed values, float16 scales and zero points, K per channel and V
per token), the bytes of one running sequence (`ModelSpec.sequence_bytes`: its pool blocks plus,
for int4/int2, its open-page slot: the open page in the model dtype less the packed value bytes of
its pool page, which hold the open page's head until the page fills), how many such
sequences ``budget_gib`` of KV holds and their tokens, and the ratio to the model dtype's tokens.
``open_page_without_pool_page`` is the same count for a design this code does not build (the
open page's pool page allocated only when it fills: ``n // page`` packed blocks plus the whole
open page in the model dtype), for comparison. ``scale_share`` is the scales' and zeros'
fraction of a block. Evidence: constructed (fixed-length sequences; exact accounting, which a
test checks against the allocated arrays' ``nbytes``).

Writes ``kivi_capacity.json``.
"""

from __future__ import annotations

from experiments import common
from experiments.configs.kivi_capacity import MODELS
from paged.accounting.formulas import ModelSpec, blocks_needed


def check(c) -> dict:
    unknown = sorted(set(c.models) - set(MODELS))
    if unknown:
        raise ValueError(f"models {unknown} unknown; known: {sorted(MODELS)}")
    if "auto" not in c.formats:
        raise ValueError(f"formats={c.formats} must hold 'auto' (the baseline)")
    common.check_positive(budget_gib=c.budget_gib, **{f"page_sizes[{i}]": p for i, p in
                                                      enumerate(c.page_sizes)},
                          **{f"seq_lens[{i}]": n for i, n in enumerate(c.seq_lens)})
    specs = {(m, f): ModelSpec(*MODELS[m], c.dtype, kv_cache_dtype=f) for m in c.models
             for f in c.formats}  # refuses an unknown format
    return {"specs": specs}


def row(spec: ModelSpec, page: int, n: int, budget: int) -> dict:
    seq = spec.sequence_bytes(n, page)
    held = budget // seq
    out = {"bytes_per_block": spec.bytes_per_block(page),
           "scale_share": spec.scale_bytes_per_block(page) / spec.bytes_per_block(page),
           "open_page_bytes": spec.open_page_bytes(page), "sequence_bytes": seq,
           "sequences_held": held, "tokens_held": held * n}
    if spec.packed_bits is not None:
        whole = spec.open_page_bytes(page) + spec.value_bytes_per_block(page)  # a dtype page
        alt = (n // page) * spec.bytes_per_block(page) + whole
        out["open_page_without_pool_page"] = {"sequence_bytes": alt,
                                              "tokens_held": budget // alt * n}
    assert blocks_needed(n, page) * spec.bytes_per_block(page) <= seq
    return out


def main(c, plan) -> None:
    budget = int(c.budget_gib * (1 << 30))
    rows = []
    for model in c.models:
        for page in c.page_sizes:
            for n in c.seq_lens:
                base = row(plan["specs"][(model, "auto")], page, n, budget)
                for fmt in c.formats:
                    r = {"model": model, "page_size": page, "seq_len": n, "format": fmt,
                         **row(plan["specs"][(model, fmt)], page, n, budget)}
                    r["tokens_over_model_dtype"] = r["tokens_held"] / base["tokens_held"]
                    if "open_page_without_pool_page" in r:
                        alt = r["open_page_without_pool_page"]
                        alt["tokens_over_model_dtype"] = alt["tokens_held"] / base["tokens_held"]
                    rows.append(r)
                    print(f"{model:13s} page {page:3d} n {n:5d} {fmt:5s} "
                          f"block {r['bytes_per_block']:>10,d} B  scales {r['scale_share']:.3f}  "
                          f"tokens {r['tokens_held']:>12,d}  x{r['tokens_over_model_dtype']:.3f}")
    payload = {"study": "kivi_capacity", "evidence": "constructed", "config": c.to_dict(),
               "budget_bytes": budget, "rows": rows, "provenance": common.provenance()}
    path = common.write_result(common.output_dir(c, "kivi_capacity") / "kivi_capacity.json",
                               payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    common.run("kivi_capacity", main, check)
