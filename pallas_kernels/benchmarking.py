"""The logic of `experiments/kernel_bench.py`: data, runners, correctness check, interleaved timing.

Kept out of the script so it is importable and tested (``tests/test_kernels_bench.py`` runs the
smoke config end to end).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from pallas_kernels import testing, xla
from pallas_kernels.gpu_common import GpuPagedConfig, next_pow2
from pallas_kernels.tpu_common import TpuPagedConfig

REFERENCE_BYTES_LIMIT = 2 << 30  # above this the "xla" path (tested against it) is the oracle


def _itemsize(dtype) -> int:
    return 2 if str(dtype) == "bfloat16" else np.dtype(dtype).itemsize


def build_decode(config, rng) -> dict:
    """Decode data: ``batch`` sequences of ``context`` tokens in a shuffled page pool."""
    h, page = config.heads, config.page_size
    batch, context = config.decode.batch, config.decode.context
    pps = -(-context // page)
    case = testing.make_paged_case(
        rng, [context] * batch, num_kv_heads=h.num_kv_heads, head_dim=h.head_dim,
        page_size=page, pages_per_seq=pps, extra_pages=config.extra_pages, dtype=config.dtype,
    )  # fmt: skip
    q = testing.random_q(rng, (batch, h.num_q_heads, h.head_dim), config.dtype)
    size = _itemsize(config.dtype)
    kv_bytes = 2 * int(case.lengths.sum()) * h.num_kv_heads * h.head_dim * size
    return {
        "args": (q, case.k_pages, case.v_pages, case.lengths, case.page_indices),
        "dense_args": (q[:, None], case.k_dense, case.v_dense, case.lengths),
        "live_rows": np.arange(batch),
        "dense_rows": (np.arange(batch), np.zeros(batch, np.int64)),
        "bytes": kv_bytes + 2 * q.size * size,
        "reference_bytes": 2 * batch * pps * page * h.num_kv_heads * h.head_dim * 4,
        "shape": f"B={batch} context={context} Hq={h.num_q_heads} Hkv={h.num_kv_heads} "
        f"D={h.head_dim} page={page} {config.dtype}",
    }


def ragged_seqs(rc) -> list[tuple[int, int]]:
    """``(kv_len, q_len)`` of a mixed step: prefill chunks, decodes, 4-token verifications."""
    return (
        [(rc.prefill_context, rc.prefill_chunk)] * rc.num_prefills
        + [(rc.decode_context, 1)] * rc.num_decodes
        + [(rc.decode_context, 4)] * rc.num_verify
    )


def build_ragged(config, rng) -> dict:
    """Ragged data: one mixed step, tokens padded to a power of two as an engine would bucket."""
    h, page = config.heads, config.page_size
    seqs = ragged_seqs(config.ragged)
    pps = -(-max(kv for kv, _ in seqs) // page)
    live = sum(q_len for _, q_len in seqs)
    q, case, cu, n = testing.make_ragged_case(
        rng, seqs, num_q_heads=h.num_q_heads, num_kv_heads=h.num_kv_heads, head_dim=h.head_dim,
        page_size=page, pages_per_seq=pps, pad_tokens=next_pow2(live) - live,
        dtype=config.dtype,
    )  # fmt: skip
    # Dense equivalent: queries right-aligned in [S, Qmax] (the last q_len of kv_len tokens).
    num, q_max = len(seqs), max(q_len for _, q_len in seqs)
    q_dense = np.zeros((num, q_max, *q.shape[1:]), q.dtype)
    seq_of_row, slot_of_row = [], []
    for i, (_, q_len) in enumerate(seqs):
        q_dense[i, q_max - q_len :] = q[cu[i] : cu[i + 1]]
        seq_of_row += [i] * q_len
        slot_of_row += list(range(q_max - q_len, q_max))
    size = _itemsize(config.dtype)
    kv_bytes = 2 * sum(kv for kv, _ in seqs) * h.num_kv_heads * h.head_dim * size
    return {
        "args": (q, case.k_pages, case.v_pages, case.lengths, case.page_indices, cu, n),
        "dense_args": (q_dense, case.k_dense[:num], case.v_dense[:num], case.lengths[:num]),
        "live_rows": np.arange(live),
        "dense_rows": (np.asarray(seq_of_row), np.asarray(slot_of_row)),
        "bytes": kv_bytes + 2 * live * h.num_q_heads * h.head_dim * size,
        "reference_bytes": 2 * q.shape[0] * pps * page * h.num_kv_heads * h.head_dim * 4,
        "shape": f"{len(seqs)} seqs ({config.ragged.num_prefills} prefill chunks of "
        f"{config.ragged.prefill_chunk}, {config.ragged.num_decodes} decodes, "
        f"{config.ragged.num_verify} verify x4) T={q.shape[0]} Hq={h.num_q_heads} "
        f"Hkv={h.num_kv_heads} D={h.head_dim} page={page} {config.dtype}",
    }


def split_variant(name: str) -> tuple[str, str]:
    """``"pallas_gpu@unmasked"`` -> ``("pallas_gpu", "unmasked")``: bench-only kernel variants."""
    impl, _, variant = name.partition("@")
    return impl, variant


def kernel_config(name: str, config):
    """The tuning dataclass the bench passes to ``name`` (None for reference / JAX kernels).

    Variant ``@unmasked`` selects the GPU-style kernels' null-page gather fallback.
    """
    impl, variant = split_variant(name)
    if impl == "xla":
        return pk.XlaConfig(
            block_tokens=config.xla_block_tokens, items_per_group=config.xla_items_per_group
        )
    if impl == "reference" or impl.startswith("jax_"):
        return None
    _, style, interpret = pk.resolve_impl(impl)
    if style == "tpu":
        return TpuPagedConfig(
            pages_per_compute_block=config.tpu_pages_per_compute_block, strict_interpret=False
        )
    return GpuPagedConfig(
        pages_per_compute_block=config.gpu_pages_per_compute_block,
        k_splits=config.gpu_k_splits, queries_per_block=config.gpu_queries_per_block,
        masked_gather=variant != "unmasked",
    )  # fmt: skip


def _divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def jax_paged_fn(impl: str, config, sm_scale: float) -> Callable:
    """JAX's own Pallas paged-attention kernels (decode only), q pre-scaled (they take no scale)."""
    if impl.startswith("jax_gpu"):
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_gpu

        def fn(q, k, v, lengths, table):
            pps = table.shape[1]
            splits = _divisor_at_most(pps, config.gpu_k_splits)
            ppb = _divisor_at_most(pps // splits, config.gpu_pages_per_compute_block)
            return jax_gpu.paged_attention(
                q * sm_scale, k, v, table, lengths, pages_per_compute_block=ppb,
                k_splits=splits, interpret=impl.endswith("interpret"),
            )  # fmt: skip

        return jax.jit(fn)
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as jax_tpu

    def fn(q, k, v, lengths, table):
        ppb = _divisor_at_most(table.shape[1], config.tpu_pages_per_compute_block)
        return jax_tpu(q * sm_scale, k, v, lengths, table, pages_per_compute_block=ppb)

    jitted = jax.jit(fn)
    if not impl.endswith("interpret"):
        return jitted

    def interpreted(*args):
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
            return jitted(*args)

    return interpreted


def paged_fn(op: str, impl: str, config, sm_scale: float) -> Callable:
    if impl.startswith("jax_"):
        if op != "decode":
            raise ValueError(f"{impl=} is a decode kernel; JAX's ragged kernel uses another layout")
        return jax_paged_fn(impl, config, sm_scale)
    kw = {
        "sm_scale": sm_scale,
        "impl": split_variant(impl)[0],
        "config": kernel_config(impl, config),
    }
    op_fn = pk.paged_attention if op == "decode" else pk.ragged_paged_attention
    return jax.jit(lambda *a: op_fn(*a, **kw))


def dense_impl(impl: str) -> str:
    impl = split_variant(impl)[0]
    return "xla" if impl.startswith("jax_") else impl


def dense_fn(impl: str, sm_scale: float) -> Callable:
    def fn(q, k, v, kv_lens):
        return pk.flash_attention(q, k, v, kv_lens=kv_lens, sm_scale=sm_scale, impl=impl)

    return jax.jit(fn)


HEAD_MAJOR = "xla_head_major"  # the second dense baseline of the "xla" family


def dense_head_major_fn(sm_scale: float) -> Callable:
    """Dense "xla" attention on ``[B, Hkv, Tk, D]`` K/V (no per-block transpose; see ``xla.py``)."""

    def fn(q, k, v, kv_lens):
        return xla.flash_attention(q, k, v, kv_lens=kv_lens, sm_scale=sm_scale, kv_head_major=True)

    return jax.jit(fn)


def _block(x):
    return jax.block_until_ready(x)


def interleaved_medians(runs: dict, *, repeats: int, warmup: int) -> dict:
    """Times every ``name -> (fn, args)`` in rotating order each round; returns seconds lists."""
    names = list(runs)
    for name in names:
        fn, args = runs[name]
        for _ in range(warmup):
            _block(fn(*args))
    times = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, args = runs[name]
            t0 = time.perf_counter()
            _block(fn(*args))
            times[name].append(time.perf_counter() - t0)
    return times


# JAX's TPU paged kernel rounds K/V to bfloat16 internally (its dequantise step).
LOOSE_TOLERANCE = {"jax_tpu": 2e-2, "jax_tpu_interpret": 2e-2}


def _compare(out, oracle, rows, config, impl="") -> tuple[bool, float]:
    got = np.asarray(out, np.float64)[rows]
    want = np.asarray(oracle, np.float64)
    err = float(np.max(np.abs(got - want))) if got.size else 0.0
    rtol = max(config.rtol, LOOSE_TOLERANCE.get(impl, 0.0))
    atol = max(config.atol, LOOSE_TOLERANCE.get(impl, 0.0))
    ok = bool(np.all(np.isfinite(got))) and np.allclose(got, want, rtol=rtol, atol=atol)
    return ok, err


def bench_op(config, op: str, data: dict, impls: list[str], *, peak_gbps: float) -> dict:
    """Checks then times ``impls`` on ``data``; returns the op's JSON record."""
    sm_scale = config.heads.head_dim**-0.5
    args = tuple(jnp.asarray(a) for a in data["args"])
    dense_args = tuple(jnp.asarray(a) for a in data["dense_args"])
    oracle_impl = "reference" if data["reference_bytes"] <= REFERENCE_BYTES_LIMIT else "xla"
    oracle = np.asarray(paged_fn(op, oracle_impl, config, sm_scale)(*args), np.float64)
    oracle = oracle[data["live_rows"]]
    rec = {"shape": data["shape"], "oracle": oracle_impl, "bytes": data["bytes"], "impls": {}}
    rec["dense"] = {}
    runs = {}
    for impl in impls:
        try:
            fn = paged_fn(op, impl, config, sm_scale)
            ok, err = _compare(fn(*args), oracle, data["live_rows"], config, impl)
            rec["impls"][impl] = {"correct": ok, "max_abs_err": err, "dense_impl": dense_impl(impl)}
            runs[impl] = (fn, args)
        except Exception as e:  # noqa: BLE001 - one broken backend must not hide the others
            rec["impls"][impl] = {"error": f"{type(e).__name__}: {e}"}
            continue
        d = dense_impl(impl)
        if d in rec["dense"]:
            continue
        try:
            fn = dense_fn(d, sm_scale)
            seq, slot = data["dense_rows"]
            out = np.asarray(fn(*dense_args), np.float64)[seq, slot]
            ok, err = _compare(out, oracle, slice(None), config)
            rec["dense"][d] = {"correct": ok, "max_abs_err": err}
            runs[f"dense:{d}"] = (fn, dense_args)
        except Exception as e:  # noqa: BLE001
            rec["dense"][d] = {"error": f"{type(e).__name__}: {e}"}
    if config.dense_head_major and "correct" in rec["dense"].get("xla", {}):
        # The same contiguous data with each head's keys contiguous: what paging costs against a
        # dense cache laid out for the kernel, not only against the [B, T, Hkv, D] layout.
        q_d, k_d, v_d, lens_d = dense_args
        hm_args = (q_d, jnp.swapaxes(k_d, 1, 2), jnp.swapaxes(v_d, 1, 2), lens_d)
        fn = dense_head_major_fn(sm_scale)
        seq, slot = data["dense_rows"]
        ok, err = _compare(np.asarray(fn(*hm_args), np.float64)[seq, slot], oracle, slice(None),
                           config)  # fmt: skip
        rec["dense"][HEAD_MAJOR] = {"correct": ok, "max_abs_err": err}
        runs[f"dense:{HEAD_MAJOR}"] = (fn, hm_args)
    times = interleaved_medians(runs, repeats=config.repeats, warmup=config.warmup)
    for name, ts in times.items():
        median = float(np.median(ts))
        entry = rec["dense"][name[6:]] if name.startswith("dense:") else rec["impls"][name]
        entry.update(median_ms=1e3 * median, min_ms=1e3 * float(np.min(ts)), rounds=len(ts))
        if not name.startswith("dense:"):
            entry["achieved_gbps"] = data["bytes"] / median / 1e9
            entry["fraction_of_peak"] = entry["achieved_gbps"] / peak_gbps
    for entry in rec["impls"].values():
        dense = rec["dense"].get(entry.get("dense_impl"), {})
        if "median_ms" in entry and "median_ms" in dense:
            entry["ratio_to_dense"] = entry["median_ms"] / dense["median_ms"]
        head_major = rec["dense"].get(HEAD_MAJOR, {})
        if entry.get("dense_impl") == "xla" and "median_ms" in entry and "median_ms" in head_major:
            entry["ratio_to_dense_head_major"] = entry["median_ms"] / head_major["median_ms"]
    return rec
