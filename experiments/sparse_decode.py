"""Quest page selection (sparse decode) against dense paged decode: K/V bytes read per decode
step, attention time, and needle retrieval on the real model.

**Kernel points** (``config.contexts`` x ``config.fractions``): one decode step of ``batch``
sequences of ``context`` tokens in a shuffled page pool (random K/V, `pallas_kernels.testing`).
Dense is `pallas_kernels.paged_attention` over every page; sparse is
`pallas_kernels.page_select.sparse_paged_attention` (the selection from the page key bounds,
then the same decode op over the selected pages), both jitted, same ``impl``. Bytes are counted
from the selection's output (`page_select.bytes_read`: whole pages of K and V, plus the bounds
of every page the scores read), per layer. Timing is interleaved rounds (dense, sparse, read,
...; `experiments.kernel_bench_lib`), headline = median over rounds of sparse / dense time. The
``read`` run sums the whole pool once: the byte rate a plain streaming read reaches on this
device (its own byte roofline); each op's bytes / time over it is ``frac_of_read_roofline``.

**Retrieval** (``config.retrieval_lengths``): `experiments.quality`'s needle prompts on
SmolLM2-135M through the engine, per arm of ``config.arms``: dense, or ``"F:L"`` =
``EngineConfig(sparse_decode=SparseDecodeConfig(fraction=F, dense_layers=L))`` (prefill is dense
in both; only decode rows select; the first L layers read every page), or ``"F:L:G"`` with
``gqa=G`` (how a query group picks its pages: ``max``, ``rank``, ``union``), or ``"F:L:G:R"``
with ``recent_pages=R`` (the R pages before the open page always read, inside the budget).

**Fidelity** (``config.fidelity_lengths``): perplexity of corpus chunks, KL(p_dense || p_arm)
and top-1 agreement with dense, teacher-forced with every token decoded through the selection
(the no-cache forward ``Llama.dense(sparse=...)``, equal to the engine's one-token rows), as
Quest's own perplexity evaluation feeds tokens one at a time.

**Answers** (``config.answer_lengths``): the same needles teacher-forced over the reference
answer, the prompt dense and every answer row reading what its selection keeps
(`experiments.sparse_decode_answers`): every arm over one prompt forward per needle, and the
pages each row reads (per KV head) on real queries and keys.

Random keys have no structure for the selection to find: the kernel points measure bytes and
time, not which pages matter; retrieval measures that.
"""

from __future__ import annotations

import functools
import os
import time

import numpy as np

from experiments import common


def check(c) -> None:
    import pallas_kernels as pk

    unknown = set(c.sparse_ops) - {"paged", "ragged"}
    if "paged" not in c.sparse_ops or unknown:
        raise ValueError(f"sparse_ops={c.sparse_ops}: 'paged' plus optionally 'ragged'")
    common.check_positive(batch=c.batch, num_q_heads=c.num_q_heads, num_kv_heads=c.num_kv_heads,
                          head_dim=c.head_dim, page_size=c.page_size, repeats=c.repeats,
                          calls=c.calls, needles_per_cell=c.needles_per_cell,
                          block_size=c.block_size)
    if c.num_q_heads % c.num_kv_heads:
        raise ValueError(f"num_q_heads={c.num_q_heads} must be a multiple of "
                         f"num_kv_heads={c.num_kv_heads}")
    if c.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype={c.dtype!r} must be float32 or bfloat16")
    for f in c.fractions:
        if not 0 < float(f) <= 1:
            raise ValueError(f"fractions has {f}: each must be in (0, 1]")
    for n in (*c.contexts, *c.retrieval_lengths, *c.fidelity_lengths, *c.answer_lengths):
        common.check_positive(length=n)
    for a in c.arms:
        parse_arm(a)
    if c.fidelity_lengths and "dense" not in c.arms:
        raise ValueError(f"arms={c.arms}: fidelity compares with 'dense'; add it")
    pk.resolve_impl(c.impl)


def _bounds(case, page: int) -> np.ndarray:
    """[Hkv, P, 2, D] key bounds of the case's pages (the write path's result, in numpy)."""
    k = np.asarray(case.k_pages, np.float32)  # NaN past each length
    valid = ~np.isnan(k).all(axis=-1, keepdims=True)
    lo = np.where(valid, k, np.inf).min(axis=2)
    hi = np.where(valid, k, -np.inf).max(axis=2)
    return np.stack([lo, hi], axis=2).astype(case.k_pages.dtype)


def kernel_point(c, context: int, fraction: float, rng) -> dict:
    import jax
    import jax.numpy as jnp

    import pallas_kernels as pk
    from experiments import kernel_bench_lib as kb
    from pallas_kernels import page_select, testing

    page = c.page_size
    pps = -(-context // page)
    case = testing.make_paged_case(rng, [context] * c.batch, num_kv_heads=c.num_kv_heads,
                                   head_dim=c.head_dim, page_size=page, pages_per_seq=pps,
                                   extra_pages=0, dtype=c.dtype)
    bounds = _bounds(case, page)
    q = testing.random_q(rng, (c.batch, c.num_q_heads, c.head_dim), c.dtype)
    k_pages, v_pages = (np.nan_to_num(np.asarray(x, np.float32)).astype(x.dtype)
                        for x in (case.k_pages, case.v_pages))  # NaN garbage: time real math
    args = tuple(map(jnp.asarray, (q, k_pages, v_pages, case.lengths, case.page_indices)))
    active = jnp.ones((c.batch,), bool)
    sm = c.head_dim**-0.5
    dense_fn = jax.jit(functools.partial(pk.paged_attention, sm_scale=sm, impl=c.impl))
    def sparse_fn(op):
        return jax.jit(lambda q, k, v, b, n, t, a: page_select.sparse_paged_attention(
            q, k, v, b, n, t, a, budget=float(fraction), sm_scale=sm, impl=c.impl, op=op))

    read_fn = jax.jit(lambda k, v: jnp.sum(k, dtype=jnp.float32) + jnp.sum(v, dtype=jnp.float32))
    sparse_args = (*args[:3], jnp.asarray(bounds), *args[3:], active)
    qs = np.asarray(q, np.float32).reshape(c.batch, c.num_kv_heads, -1, c.head_dim)
    _, sel = page_select.select_pages_jit(qs, bounds, case.lengths, case.page_indices,
                                          np.asarray(active), page_size=page,
                                          budget=float(fraction))
    itemsize = 2 if c.dtype == "bfloat16" else 4
    counted = page_select.bytes_read(case.lengths, np.asarray(sel), page_size=page,
                                     head_dim=c.head_dim, itemsize=itemsize)
    arms = {"dense": (dense_fn, args), "sparse": (sparse_fn("paged"), sparse_args),
            "read": (read_fn, args[1:3])}
    if "ragged" in c.sparse_ops:  # the same selection through the ragged kernel
        arms["sparse_ragged"] = (sparse_fn("ragged"), sparse_args)
    times = kb.interleaved_rounds(arms, repeats=c.repeats, warmup=c.warmup, calls=c.calls)
    med = {k: float(np.median(v)) for k, v in times.items()}
    pool = int(k_pages.nbytes + v_pages.nbytes)
    rate = pool / med["read"]
    ragged = {} if "sparse_ragged" not in med else {
        "sparse_ragged_ms": 1e3 * med["sparse_ragged"],
        "time_ratio_ragged": kb.per_round_ratios(times["sparse_ragged"], times["dense"]),
        "frac_of_read_roofline_ragged": counted["sparse"] / med["sparse_ragged"] / rate}
    return {**ragged,
        "context": context, "fraction": float(fraction), "pages_per_seq": pps,
        "selected_pages_per_head": float(np.mean(-(-np.asarray(sel) // page))),
        "bytes": counted, "bytes_ratio": counted["sparse"] / counted["dense"],
        "dense_ms": 1e3 * med["dense"], "sparse_ms": 1e3 * med["sparse"],
        "time_ratio": kb.per_round_ratios(times["sparse"], times["dense"]),
        "read_bytes_per_s": rate,
        "frac_of_read_roofline": {"dense": counted["dense"] / med["dense"] / rate,
                                  "sparse": counted["sparse"] / med["sparse"] / rate},
    }


def parse_arm(text: str) -> tuple[float | None, int, str, int]:
    """An arm of ``config.arms``: ``"dense"`` -> ``(None, 0, "max", 0)``, ``"F:L"`` -> ``(F, L,
    "max", 0)``, ``"F:L:G"`` -> ``(F, L, G, 0)``, ``"F:L:G:R"`` -> ``(F, L, G, R)``: budget
    fraction F of each sequence's pages, selection skipped in the first L layers, query groups
    picking pages by ``gqa=G``, the R pages before the open page always read
    (``recent_pages=R``, inside the budget)."""
    from paged.config.sparse_decode import GQA_MODES

    text = str(text)
    if text == "dense":
        return None, 0, "max", 0
    parts = text.split(":")
    try:
        f, n = float(parts[0]), int(parts[1])
        r = int(parts[3]) if len(parts) == 4 else 0
    except (ValueError, IndexError):
        f, n, r = -1.0, -1, -1
    gqa = parts[2] if len(parts) >= 3 else "max"
    if (len(parts) not in (2, 3, 4) or not 0 < f <= 1 or n < 0 or r < 0
            or gqa not in GQA_MODES):
        raise ValueError(f"arm {text!r}: 'dense' or 'F:L[:G[:R]]' with F in (0, 1] (a fraction "
                         f"of the pages), L >= 0 (layers that read every page), G in "
                         f"{GQA_MODES} (SparseDecodeConfig.gqa) and R >= 0 "
                         f"(SparseDecodeConfig.recent_pages)")
    return f, n, gqa, r


def _arm_row(arm: str) -> dict:
    f, n, gqa, r = parse_arm(arm)
    return {"arm": arm, "fraction": f, "dense_layers": None if f is None else n,
            "gqa": None if f is None else gqa, "recent_pages": None if f is None else r}


def retrieval_rows(c, rows: list, save) -> list[dict]:
    """Appends one row per (length, arm) to ``rows``, calling ``save()`` after each (a run
    stopped by its time limit keeps what it measured)."""
    from experiments import quality
    from experiments import quality_tasks as tasks
    from paged.config.sparse_decode import SparseDecodeConfig
    from paged.models.registry import load_any

    config, params, tok = load_any(c.model)
    corpus = tok.encode(tasks.corpus_text(), add_bos=False)
    for length in c.retrieval_lengths:
        needle_list = [n for d in c.retrieval_depths
                       for n in tasks.needles(tok, corpus, length, d, c.needles_per_cell, c.seed)]
        max_len = -(-(max(len(n.prompt_ids) for n in needle_list) + 32) // c.block_size)
        qc = quality_config(c)
        for arm in c.arms:
            t = time.perf_counter()
            f, n, gqa, r = parse_arm(arm)
            sparse = None if f is None else SparseDecodeConfig(fraction=f, dense_layers=n,
                                                               gqa=gqa, recent_pages=r)
            engine = quality.make_engine(qc, quality.Arm("float32"), config, params,
                                         max_len * c.block_size, sparse_decode=sparse)
            acc, outs = quality.retrieval(engine, needle_list)
            rows.append({"length": length, **_arm_row(arm), "accuracy": acc,
                         "needles": len(needle_list),
                         "answers": [o.text for o in outs], "seconds": time.perf_counter() - t})
            print(f"retrieval {length} {arm}: {acc['all']:.3f}", flush=True)
            save()
    return rows


def fidelity_rows(c, rows: list, save) -> list[dict]:
    """Teacher-forced perplexity, KL(p_dense || p_arm) and top-1 agreement per (length, arm)
    over ``fidelity_chunks`` corpus chunks: the no-cache forward with every position reading
    what its decode row would select (``Llama.dense(sparse=...)``; equal to the engine's
    one-token rows, ``tests/test_sparse_decode_engine.py``), i.e. every token decoded."""
    import jax
    import jax.numpy as jnp

    from experiments import quality
    from experiments import quality_tasks as tasks
    from paged.models.llama import Llama
    from paged.models.registry import load_any

    config, params, tok = load_any(c.model)
    corpus = tok.encode(tasks.corpus_text(), add_bos=False)
    model = Llama(config)
    fwd = jax.jit(lambda p, t, sparse: jax.nn.log_softmax(
        model.apply(p, t, method="dense", sparse=sparse), -1), static_argnums=2)
    for length in c.fidelity_lengths:
        chunk_list = tasks.chunks(corpus, length, c.fidelity_chunks)
        ref = None
        for arm in ("dense", *[a for a in c.arms if a != "dense"]):
            t = time.perf_counter()
            f, n, gqa, r = parse_arm(arm)
            sparse = None if f is None else (f, c.block_size, n, gqa, r)
            lps = [np.asarray(fwd(params, jnp.asarray([ids], jnp.int32), sparse)[0], np.float64)
                   for ids in chunk_list]
            nll = np.array([[-lp[i, ids[i + 1]] for i in range(len(ids) - 1)]
                            for lp, ids in zip(lps, chunk_list, strict=True)])
            ref = lps if ref is None else ref
            tail = (3 * length) // 4  # positions whose context is >= 3/4 of the chunk
            rows.append({"length": length, **_arm_row(arm), "chunks": len(chunk_list),
                         "perplexity": float(np.exp(nll.mean())), "nll_mean": float(nll.mean()),
                         **quality.fidelity(ref, lps),
                         "tail_from": tail, "tail_perplexity": float(np.exp(nll[:, tail:].mean())),
                         "tail": quality.fidelity([r[tail:] for r in ref], [x[tail:] for x in lps]),
                         "seconds": time.perf_counter() - t})
            r = rows[-1]
            print(f"fidelity {length} {arm}: ppl {r['perplexity']:.3f} KL {r['kl_mean']:.4f} "
                  f"top1 {r['top1_agreement']:.3f}; last quarter: ppl {r['tail_perplexity']:.3f} "
                  f"KL {r['tail']['kl_mean']:.4f}", flush=True)
            save()
    return rows


def quality_config(c):
    import ml_collections

    return ml_collections.ConfigDict({"model": c.model, "block_size": c.block_size,
                                      "max_num_batched_tokens": c.max_num_batched_tokens})


def main(c, _plan) -> None:
    out_dir = common.output_dir(c, "sparse_decode")
    rng = np.random.default_rng(c.seed)
    grid = [(int(n), float(f)) for n in c.contexts for f in c.fractions]
    payload = {"study": "sparse_decode", "config": c.to_dict(), "provenance": common.provenance(),
               "evidence": {"kernel": "constructed", "retrieval": "constructed"},  # random K/V; needles
               "load_before": os.getloadavg(), "points": [], "retrieval": []}
    with common.Progress(len(grid), "sparse_decode", unit="points") as bar:
        for n, f in grid:
            rec = kernel_point(c, n, f, rng)
            payload["points"].append(rec)
            bar.update()
            print(f"ctx={n:<5} budget={f:<7} bytes {rec['bytes_ratio']:.3f}x dense; time "
                  f"{rec['sparse_ms']:.3f} / {rec['dense_ms']:.3f} ms = "
                  f"{rec['time_ratio']['median']:.3f} [{rec['time_ratio']['q1']:.3f}, "
                  f"{rec['time_ratio']['q3']:.3f}]", flush=True)
            path = common.write_result(out_dir / "sparse_decode.json", payload)
    save = lambda: common.write_result(out_dir / "sparse_decode.json", payload)  # noqa: E731
    if c.fidelity_lengths:
        payload["evidence"]["fidelity"] = "real"  # corpus text, teacher-forced
        payload["fidelity"] = []
        fidelity_rows(c, payload["fidelity"], save)
    if c.answer_lengths:
        from experiments import sparse_decode_answers

        payload["evidence"]["answers"] = "constructed"  # needles, teacher-forced
        payload["answers"] = []
        sparse_decode_answers.answer_rows(c, payload["answers"], save, parse_arm)
    if c.retrieval_lengths:
        retrieval_rows(c, payload["retrieval"], save)
    payload["load_after"] = os.getloadavg()
    path = common.write_result(out_dir / "sparse_decode.json", payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    common.run("sparse_decode", main, check)
