"""The logic of `experiments/kernel_bench.py`: data, runners, correctness check, interleaved timing.

Kept out of the script so it is importable and tested (``tests/test_kernels_bench.py`` runs the
smoke config end to end).

Timing: every implementation and baseline is timed once per round, the order alternating forward
and backward (A, B, C, C, B, A, A, B, ...), so each baseline is timed right next to what it is
compared with, each side first half of the time. Ratios are taken per round (both sides measured
within the same second or so, under the same load from whatever else runs on the machine) and
reported with their spread over rounds (median, min, max, quartiles, IQR); the headline ratio is
the median of the per-round ratios.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from pallas_kernels import quant, testing, xla
from pallas_kernels.gpu_common import GpuPagedConfig, next_pow2
from pallas_kernels.tpu_common import TpuPagedConfig

REFERENCE_BYTES_LIMIT = 2 << 30  # default: above this the "xla" path (tested against it) is the oracle


def _itemsize(dtype) -> int:
    return 2 if str(dtype) == "bfloat16" else np.dtype(dtype).itemsize


def dense_groups(q, case, seqs, cu) -> tuple[tuple, list]:
    """The dense baseline of a paged step: one contiguous ``flash_attention`` call per distinct
    query length, over exactly the sequences that have it.

    ``seqs`` holds ``(kv_len, q_len)`` per sequence and ``cu`` the cumulative query lengths (the
    token rows of sequence ``i`` in ``q`` are ``cu[i]:cu[i+1]``). Each group gets ``q``
    ``[n, q_len, Hq, D]`` (the sequences' own rows, nothing padded), K/V ``[n, Tk, Hkv, D]`` cut
    to the group's longest context, and ``kv_lens``: the same query rows and the same causal keys
    as the paged call, so paged/dense compares equal work. Returns ``(args, rows)``: the groups'
    arrays back to back (4 per group) and per group the token row of each output row.
    """
    args, rows = [], []
    for q_len in sorted({q_len for _, q_len in seqs}, reverse=True):
        idx = np.asarray([i for i, (_, n) in enumerate(seqs) if n == q_len])
        tk = max(seqs[i][0] for i in idx)
        contiguous = np.array_equal(idx, np.arange(idx[0], idx[0] + len(idx)))
        pick = slice(idx[0], idx[0] + len(idx)) if contiguous else idx  # a view when possible
        tokens = np.concatenate([np.arange(cu[i], cu[i + 1]) for i in idx])
        args += [q[tokens].reshape(len(idx), q_len, *q.shape[1:]), case.k_dense[pick, :tk],
                 case.v_dense[pick, :tk], case.lengths[pick]]  # fmt: skip
        rows.append(tokens)
    return tuple(args), rows


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
    dense_args, dense_rows = dense_groups(q, case, [(context, 1)] * batch, np.arange(batch + 1))
    return {
        "args": (q, case.k_pages, case.v_pages, case.lengths, case.page_indices),
        "dense_args": dense_args,
        "live_rows": np.arange(batch),
        "dense_rows": dense_rows,
        "bytes": kv_bytes + 2 * q.size * size,
        "q_bytes": 2 * q.size * size,
        "kv_tokens": int(case.lengths.sum()),
        "kv_pages": int(sum(-(-int(n) // page) for n in case.lengths)),
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
    """Ragged data: one mixed step, tokens padded to a power of two as an engine would bucket;
    its dense baseline is one call per query length (:func:`dense_groups`)."""
    h, page = config.heads, config.page_size
    seqs = ragged_seqs(config.ragged)
    pps = -(-max(kv for kv, _ in seqs) // page)
    live = sum(q_len for _, q_len in seqs)
    q, case, cu, n = testing.make_ragged_case(
        rng, seqs, num_q_heads=h.num_q_heads, num_kv_heads=h.num_kv_heads, head_dim=h.head_dim,
        page_size=page, pages_per_seq=pps, pad_tokens=next_pow2(live) - live,
        dtype=config.dtype,
    )  # fmt: skip
    dense_args, dense_rows = dense_groups(q, case, seqs, cu)
    size = _itemsize(config.dtype)
    kv_bytes = 2 * sum(kv for kv, _ in seqs) * h.num_kv_heads * h.head_dim * size
    return {
        "args": (q, case.k_pages, case.v_pages, case.lengths, case.page_indices, cu, n),
        "dense_args": dense_args,
        "live_rows": np.arange(live),
        "dense_rows": dense_rows,
        "bytes": kv_bytes + 2 * live * h.num_q_heads * h.head_dim * size,
        "q_bytes": 2 * live * h.num_q_heads * h.head_dim * size,
        "kv_tokens": sum(kv for kv, _ in seqs),
        "kv_pages": sum(-(-kv // page) for kv, _ in seqs),
        "reference_bytes": 2 * q.shape[0] * pps * page * h.num_kv_heads * h.head_dim * 4,
        "shape": f"{len(seqs)} seqs ({config.ragged.num_prefills} prefill chunks of "
        f"{config.ragged.prefill_chunk}, {config.ragged.num_decodes} decodes, "
        f"{config.ragged.num_verify} verify x4) T={q.shape[0]} Hq={h.num_q_heads} "
        f"Hkv={h.num_kv_heads} D={h.head_dim} page={page} {config.dtype}",
    }


def kv_read_bytes(data: dict, config, kv_cache_dtype: str, granularity: str) -> int:
    """Bytes a step must move with a quantized pool: the valid keys' and values' quantized values
    plus their float32 scales (per valid token for "token", per touched page for "page"), plus q
    and the output in the model dtype (queries are never quantized)."""
    h = config.heads
    value = data["kv_tokens"] * h.head_dim * quant.storage_dtype(kv_cache_dtype).itemsize
    scales = data["kv_tokens"] if granularity == "token" else data["kv_pages"]
    scale_bytes = scales * jnp.dtype(quant.SCALE_DTYPE).itemsize
    return int(2 * h.num_kv_heads * (value + scale_bytes) + data["q_bytes"])


def quantize_data(data: dict, config, kv_cache_dtype: str, granularity: str) -> dict:
    """``data`` (of :func:`build_decode` / :func:`build_ragged`) with K/V pools quantized
    (:func:`pallas_kernels.quant.quantize_pool`) and ``bytes`` at the quantized byte count
    (:func:`kv_read_bytes`); no dense baseline (flash_attention takes no quantized K/V)."""
    dtype = quant.storage_dtype(kv_cache_dtype)
    args = list(data["args"])
    for i in (1, 2):
        args[i] = quant.quantize_pool(jnp.asarray(args[i], jnp.float32), dtype, granularity)
    return {**data, "args": tuple(args), "dense_args": (), "dense_rows": [],
            "bytes": kv_read_bytes(data, config, kv_cache_dtype, granularity),
            "shape": f"{data['shape']} kv={kv_cache_dtype}/{granularity}"}  # fmt: skip


def quant_impls(impls) -> list[str]:
    """The implementations that read quantized pages (JAX's own kernels do not)."""
    return [i for i in impls if not split_variant(i)[0].startswith("jax_")]


def split_variant(name: str) -> tuple[str, str]:
    """``"pallas_gpu@unmasked"`` -> ``("pallas_gpu", "unmasked")``: bench-only kernel variants."""
    impl, _, variant = name.partition("@")
    return impl, variant


def kernel_config(name: str, config):
    """The tuning dataclass the bench passes to ``name`` (None for reference / JAX kernels).

    Variant ``@unmasked`` selects the GPU-style kernels' null-page gather fallback, ``@heuristic``
    leaves ``k_splits`` / ``pages_per_compute_block`` to the dispatcher's heuristic
    (:func:`pallas_kernels.gpu_tuning.decode_splits`), as does a config value of 0.
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
    heuristic = variant == "heuristic"  # both knobs from pallas_kernels.gpu_tuning
    return GpuPagedConfig(
        pages_per_compute_block=None if heuristic else config.gpu_pages_per_compute_block or None,
        k_splits=None if heuristic else config.gpu_k_splits or None,
        queries_per_block=config.gpu_queries_per_block, masked_gather=variant != "unmasked",
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


HEAD_MAJOR = "xla_head_major"  # the second dense baseline of the "xla" family


def dense_fn(impl: str, sm_scale: float) -> Callable:
    """``pallas_kernels.flash_attention`` with ``impl`` over the groups of :func:`dense_groups`
    (4 arrays each), one jitted call; returns one output per group. ``impl=HEAD_MAJOR``: the "xla"
    path on ``[B, Hkv, Tk, D]`` K/V (no per-block transpose; see ``xla.py``), args from
    :func:`head_major_args`."""

    def fn(*args):
        outs = []
        for q, k, v, kv_lens in zip(*[iter(args)] * 4):
            if impl == HEAD_MAJOR:
                outs.append(xla.flash_attention(q, k, v, kv_lens=kv_lens, sm_scale=sm_scale,
                                                kv_head_major=True))  # fmt: skip
            else:
                outs.append(pk.flash_attention(q, k, v, kv_lens=kv_lens, sm_scale=sm_scale,
                                               impl=impl))  # fmt: skip
        return tuple(outs)

    return jax.jit(fn)


def head_major_args(dense_args: tuple) -> tuple:
    """The groups of :func:`dense_groups` with K/V as ``[B, Hkv, Tk, D]``."""
    out = list(dense_args)
    for i in range(0, len(out), 4):
        out[i + 1], out[i + 2] = (jnp.swapaxes(x, 1, 2) for x in out[i + 1 : i + 3])
    return tuple(out)


def dense_to_rows(outs, rows) -> np.ndarray:
    """Group outputs of :func:`dense_fn` -> float64 ``[live tokens, Hq, D]`` in token order."""
    got = np.concatenate([np.asarray(o, np.float64).reshape(-1, *o.shape[2:]) for o in outs])
    out = np.empty_like(got)
    out[np.concatenate(rows)] = got
    return out


def _block(x):
    return jax.block_until_ready(x)


def _timed(fn, args, calls: int = 1) -> float:
    """Seconds per call of ``calls`` back-to-back calls, blocking on the last only: with an
    asynchronous device, calls > 1 hides the per-call dispatch and sync latency (tens of
    microseconds, a tenth of a sub-millisecond kernel) behind the device's own time."""
    t0 = time.perf_counter()
    for _ in range(calls - 1):
        fn(*args)
    _block(fn(*args))
    return (time.perf_counter() - t0) / calls


ERROR_HEAD_CHARS = 3000  # of an exception's message kept in the JSON (lowering errors are long)
ERROR_TAIL_CHARS = 1500  # and of its end, when longer
TRACEBACK_CHARS = 3000  # end of the formatted traceback (with the chained causes)


def error_record(e: BaseException, stage: str) -> dict:
    """What the JSON keeps of a failure: type, stage, the message's head (and tail), traceback end."""
    msg = str(e)
    rec = {
        "error": f"{type(e).__name__}: {msg[:ERROR_HEAD_CHARS]}",
        "error_type": type(e).__name__,
        "error_stage": stage,
        "error_chars": len(msg),
    }
    if len(msg) > ERROR_HEAD_CHARS:
        rec["error_tail"] = msg[-ERROR_TAIL_CHARS:]
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    rec["traceback_tail"] = tb[-TRACEBACK_CHARS:]
    return rec


def interleaved_rounds(
    runs: dict, *, repeats: int, warmup: int, errors: dict | None = None, calls: int = 1
) -> dict:
    """Times every ``name -> (fn, args)`` once per round; returns ``name -> seconds per round``
    (per call, each timing ``calls`` back-to-back calls, see :func:`_timed`).

    Rounds alternate forward and backward order (A, B, C, C, B, A, A, B, ...): neighbours in
    ``runs`` are timed back to back, each first in half of the rounds, so a ratio of two runs
    taken within a round sees the same machine load on both sides. Every returned list has one
    entry per round, index ``r`` being round ``r`` (:func:`per_round_ratios` pairs them up).

    With ``errors`` (a dict), a run that raises is recorded there (:func:`error_record`, stage
    ``"timing"``), dropped, and the others go on; without it the exception propagates.
    """
    names = list(runs)

    def call(name) -> float | None:
        fn, args = runs[name]
        try:
            return _timed(fn, args, calls)
        except Exception as e:  # noqa: BLE001 - one failing run must not stop the others
            if errors is None:
                raise
            errors[name] = error_record(e, "timing")
            return None

    for name in names:
        for _ in range(warmup):
            if name in (errors or {}) or call(name) is None:
                break
    times = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            if name in (errors or {}):
                continue
            dt = call(name)
            if dt is not None:
                times[name].append(dt)
    return {name: ts for name, ts in times.items() if name not in (errors or {})}


def spread(xs) -> dict:
    """Median, min, max, quartiles and IQR of ``xs`` (e.g. per-round ratios), and their count."""
    xs = np.asarray(xs, np.float64)
    q1, median, q3 = (float(x) for x in np.percentile(xs, [25, 50, 75]))
    return {"median": median, "min": float(xs.min()), "max": float(xs.max()), "q1": q1, "q3": q3,
            "iqr": q3 - q1, "rounds": int(xs.size)}  # fmt: skip


def per_round_ratios(num, den) -> dict:
    """:func:`spread` of ``num[r] / den[r]`` over the rounds of :func:`interleaved_rounds`, plus
    the ratio of the medians and of the minima for comparison (``median`` is the headline)."""
    num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
    rec = spread(num / den)
    rec["ratio_of_medians"] = float(np.median(num) / np.median(den))
    rec["ratio_of_mins"] = float(num.min() / den.min())
    return rec


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


def oracle_candidates(data: dict, config) -> list[str]:
    """The oracle and its fallbacks: the plain reference while its gather fits
    ``config.reference_bytes_limit``, then the "xla" path (itself tested against the reference)."""
    limit = config.get("reference_bytes_limit", REFERENCE_BYTES_LIMIT)
    return ["reference", "xla"] if data["reference_bytes"] <= limit else ["xla"]


def spot_check_rows(num: int, count: int) -> list[int]:
    """``count`` sequence indices spread over ``range(num)``, first and last included."""
    if num <= 0 or count <= 0:
        return []
    return sorted({int(i) for i in np.linspace(0, num - 1, min(count, num)).round()})


def float64_spot_check(op: str, data: dict, oracle: np.ndarray, config, sm_scale: float) -> dict:
    """Checks the oracle on a few whole sequences against the float64 numpy ground truth of
    ``pallas_kernels.testing`` (which converts only those sequences' pages, so it stays cheap on a
    multi-GB pool)."""
    q, k_pages, v_pages, lengths, table = data["args"][:5]
    if isinstance(k_pages, quant.QuantizedPages):  # the float64 truth on the dequantized values
        k_pages, v_pages = quant.dequantize(k_pages), quant.dequantize(v_pages)
    if op == "decode":
        seqs = spot_check_rows(q.shape[0], config.oracle_check_seqs)
        rows = np.asarray(seqs, np.intp)
        want = testing.paged_attention_np(q[rows], k_pages, v_pages, lengths[rows], table[rows],
                                          sm_scale=sm_scale)
    else:
        cu, num = data["args"][5], int(np.asarray(data["args"][6]).reshape(-1)[0])
        seqs = spot_check_rows(num, config.oracle_check_seqs)
        rows = np.concatenate([np.arange(cu[i], cu[i + 1]) for i in seqs]).astype(np.intp)
        q_lens = [int(cu[i + 1] - cu[i]) for i in seqs]
        want = testing.ragged_paged_attention_np(
            q[rows], k_pages, v_pages, lengths[seqs], table[seqs], np.cumsum([0] + q_lens),
            len(seqs), sm_scale=sm_scale)
    got = np.asarray(oracle[rows], np.float64)
    ok = bool(np.all(np.isfinite(got))) and np.allclose(got, want, rtol=config.rtol, atol=config.atol)
    return {"seqs": seqs, "rows": len(rows), "max_abs_err": float(np.max(np.abs(got - want))),
            "correct": bool(ok)}


def quick_time(fn, args, repeats: int, calls: int = 1) -> dict:
    """Median of ``repeats`` timings taken right after the first call: a figure that survives a
    run cut short before the interleaved rounds (which give the reported medians)."""
    if repeats <= 0:
        return {}
    ts = [_timed(fn, args, calls) for _ in range(repeats)]
    return {"quick_median_ms": 1e3 * float(np.median(ts)), "quick_rounds": repeats}


def copy_fn() -> Callable:
    """Reads and writes the whole K/V pool once (``x + z`` with ``z`` a runtime zero, which XLA
    cannot fold away): the device's copy bandwidth on the very buffers the kernels read (every
    leaf: a quantized pool's values and scales)."""

    def copy(k, v, z):
        return jax.tree.map(lambda x: x + z.astype(x.dtype), (k, v))

    return jax.jit(copy)


def read_fn() -> Callable:
    """Reads the whole K/V pool once and writes two scalars: ``jnp.sum`` over each pool array in
    its own dtype, accumulated in float32 (the convert fuses into the reduction, so nothing of pool
    size is written): the read-only roofline on the very buffers the kernels read (a quantized
    pool: values and scales, each leaf summed in its own dtype)."""

    def total(x):
        return sum(jnp.sum(leaf, dtype=jnp.float32) for leaf in jax.tree.leaves(x))

    return jax.jit(lambda k, v: (total(k), total(v)))


def _cost(compiled) -> dict:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per computation
        cost = cost[0] if cost else {}
    return dict(cost or {})


def read_pass_check(fn: Callable, k, v) -> dict:
    """Whether :func:`read_fn` compiles to a single pass over the pool: XLA's own "bytes
    accessed" for the compiled program (``compiled.cost_analysis()``) against the pool's bytes,
    and the compiled HLO's fusions, none of which may produce a pool-sized array (a materialised
    float32 copy would double the traffic). ``single_pass``: bytes accessed within 1 % (+4 KiB)
    of the pool and no pool-sized intermediate."""
    compiled = fn.lower(k, v).compile()
    pool = int(k.nbytes + v.nbytes)
    cost = _cost(compiled)
    accessed = cost.get("bytes accessed")
    hlo = compiled.as_text() or ""
    entry = hlo[hlo.find("ENTRY"):] if "ENTRY" in hlo else hlo
    dims = "[" + ",".join(map(str, k.shape)) + "]"
    big = []  # non-parameter instructions of the entry computation with a pool-shaped result
    for line in entry.splitlines()[1:]:
        _, eq, rhs = line.partition(" = ")
        if eq and "parameter(" not in rhs and dims in rhs.split(" ", 1)[0]:
            big.append(line.strip()[:200])
    ok = accessed is not None and pool <= accessed <= 1.01 * pool + 4096 and not big
    return {"xla_bytes_accessed": None if accessed is None else float(accessed),
            "pool_bytes": pool, "pool_sized_intermediates": big, "single_pass": bool(ok),
            "entry_instructions": sum(1 for line in entry.splitlines() if " = " in line)}  # fmt: skip


def roofline_fractions(entry: dict, *, read_gbps, copy_gbps, datasheet_gbps) -> None:
    """Adds ``frac_of_read_roofline`` / ``frac_of_copy`` / ``frac_of_datasheet`` (achieved GB/s over
    the read-only reduction's GB/s, the copy's read + write GB/s, and the datasheet figure) to a
    timed implementation's ``entry``; a missing baseline leaves its field out."""
    gbps = entry.get("achieved_gbps")
    if not gbps:
        return
    for key, base in (("frac_of_read_roofline", read_gbps), ("frac_of_copy", copy_gbps),
                      ("frac_of_datasheet", datasheet_gbps)):  # fmt: skip
        if base:
            entry[key] = gbps / base


def timing_order(runs: dict, rec: dict) -> list[str]:
    """The order of :func:`interleaved_rounds`: the copy, then each implementation between its
    dense baseline (before it) and, for the "xla" family, the head-major baseline (after it), so
    every ratio's two sides are neighbours."""
    order = [name for name in ("read", "copy") if name in runs]
    for name, entry in rec["impls"].items():
        if name not in runs:
            continue
        dense = f"dense:{entry.get('dense_impl')}"
        order += [dense] if dense in runs and dense not in order else []
        order.append(name)
        hm = f"dense:{HEAD_MAJOR}"
        if entry.get("dense_impl") == "xla" and hm in runs and hm not in order:
            order.append(hm)
    return order + [name for name in runs if name not in order]


def bench_op(
    config,
    op: str,
    data: dict,
    impls: list[str],
    *,
    peak_gbps: float,
    on_update: Callable[[dict], None] | None = None,
    progress: Callable[[str], None] | None = None,
    dense: bool = True,
) -> dict:
    """Checks then times ``impls`` on ``data``; returns the op's JSON record.

    ``dense=False``: no dense baselines (quantized pools, see :func:`quantize_data`).

    Every failure (lowering, compile, run, numerics) is recorded under the implementation it
    belongs to and the others go on. ``on_update(rec)`` is called with the partial record after
    each step (so a caller can write it out before a timeout); ``progress`` gets one-line notes.
    """
    say = progress or (lambda msg: None)
    update = on_update or (lambda rec: None)
    sm_scale = config.heads.head_dim**-0.5
    datasheet = float(config.get("datasheet_gbps", 0.0) or peak_gbps)
    rec = {"shape": data["shape"], "bytes": data["bytes"], "impls": {}, "dense": {},
           "datasheet_gbps": datasheet}  # fmt: skip
    t0 = time.perf_counter()
    args = tuple(jax.tree.map(jnp.asarray, a) for a in data["args"])
    dense_args = tuple(jnp.asarray(a) for a in data["dense_args"])
    jax.block_until_ready((args, dense_args))
    rec["to_device_s"] = time.perf_counter() - t0
    pool_bytes = int(args[1].nbytes + args[2].nbytes)
    rec["copy"] = {"bytes": 2 * pool_bytes, "pool_bytes": pool_bytes}
    runs = {}
    quick = config.get("quick_repeats", 0)
    calls = config.get("calls_per_round", 1)
    rec["calls_per_round"] = calls
    t0 = time.perf_counter()
    try:
        copy = (copy_fn(), (args[1], args[2], jnp.zeros((), args[1].dtype)))
        jax.block_until_ready(copy[0](*copy[1]))  # compiled here, like the others' first call
        rec["copy"]["first_call_s"] = time.perf_counter() - t0
        rec["copy"].update(quick_time(*copy, quick, calls))
        if "quick_median_ms" in rec["copy"]:
            rec["copy"]["quick_gbps"] = 2 * pool_bytes / rec["copy"]["quick_median_ms"] / 1e6
        runs["copy"] = copy
    except Exception as e:  # noqa: BLE001
        rec["copy"].update(error_record(e, "correctness"))
    rec["read"] = {"bytes": pool_bytes}
    t0 = time.perf_counter()
    try:
        read = (read_fn(), (args[1], args[2]))
        rec["read"].update(read_pass_check(read[0], *read[1]))
        jax.block_until_ready(read[0](*read[1]))
        rec["read"]["first_call_s"] = time.perf_counter() - t0
        rec["read"].update(quick_time(*read, quick, calls))
        if "quick_median_ms" in rec["read"]:
            rec["read"]["quick_gbps"] = pool_bytes / rec["read"]["quick_median_ms"] / 1e6
        runs["read"] = read
    except Exception as e:  # noqa: BLE001
        rec["read"].update(error_record(e, "correctness"))

    oracle, rec["oracle"], rec["oracle_errors"] = None, None, {}
    for name in oracle_candidates(data, config):
        t0 = time.perf_counter()
        try:
            with jax.default_matmul_precision("highest"):  # no TF32 in the ground truth on GPUs
                out = paged_fn(op, name, config, sm_scale)(*args)
            oracle = np.asarray(out, np.float64)[data["live_rows"]]
            rec["oracle"], rec["oracle_s"] = name, time.perf_counter() - t0
            break
        except Exception as e:  # noqa: BLE001 - e.g. the reference's gather out of memory
            rec["oracle_errors"][name] = error_record(e, "oracle")
            say(f"{op}: oracle {name} failed: {type(e).__name__}: {str(e)[:300]}")
    if oracle is not None and config.get("oracle_check_seqs", 0):
        try:
            rec["oracle_check"] = float64_spot_check(op, data, oracle, config, sm_scale)
        except Exception as e:  # noqa: BLE001
            rec["oracle_check"] = error_record(e, "oracle_check")
    say(f"{op}: oracle {rec['oracle']} check {rec.get('oracle_check', {}).get('correct')}")
    update(rec)

    def check(out, rows, impl=""):
        if oracle is None:  # nothing to compare with: time it anyway, correctness unknown
            return None, None
        return _compare(out, oracle, rows, config, impl)

    for impl in impls:
        say(f"{op}: {impl} ...")  # a crash (not an exception) then shows where it happened
        t0 = time.perf_counter()
        try:
            fn = paged_fn(op, impl, config, sm_scale)
            out = jax.block_until_ready(fn(*args))
            first = time.perf_counter() - t0
            ok, err = check(out, data["live_rows"], impl)
            rec["impls"][impl] = {"correct": ok, "max_abs_err": err, "dense_impl": dense_impl(impl),
                                  "first_call_s": first}  # fmt: skip
            say(f"{op}: {impl} correct={ok} err={err} first call {first:.1f}s")
        except Exception as e:  # noqa: BLE001 - one broken backend must not hide the others
            rec["impls"][impl] = error_record(e, "correctness")
            rec["impls"][impl]["first_call_s"] = time.perf_counter() - t0
            say(f"{op}: {impl} ERROR {type(e).__name__}: {str(e)[:300]}")
            update(rec)
            continue
        entry = rec["impls"][impl]
        try:
            entry.update(quick_time(fn, args, quick, calls))
            if "quick_median_ms" in entry:
                entry["quick_gbps"] = data["bytes"] / entry["quick_median_ms"] / 1e6
                say(f"{op}: {impl} quick {entry['quick_median_ms']:.4f} ms "
                    f"{entry['quick_gbps']:.1f} GB/s")  # fmt: skip
            runs[impl] = (fn, args)
        except Exception as e:  # noqa: BLE001
            entry.update(error_record(e, "timing"))
        update(rec)
        d = dense_impl(impl)
        if not dense or d in rec["dense"]:
            continue
        say(f"{op}: dense {d} ...")
        t0 = time.perf_counter()
        try:
            fn = dense_fn(d, sm_scale)
            ok, err = check(dense_to_rows(fn(*dense_args), data["dense_rows"]), slice(None))
            rec["dense"][d] = {"correct": ok, "max_abs_err": err,
                               "first_call_s": time.perf_counter() - t0}  # fmt: skip
            runs[f"dense:{d}"] = (fn, dense_args)
        except Exception as e:  # noqa: BLE001
            rec["dense"][d] = error_record(e, "correctness")
            say(f"{op}: dense {d} ERROR {type(e).__name__}: {str(e)[:300]}")
        update(rec)
    if dense and config.dense_head_major and "correct" in rec["dense"].get("xla", {}):
        # The same contiguous data with each head's keys contiguous: what paging costs against a
        # dense cache laid out for the kernel, not only against the [B, T, Hkv, D] layout.
        try:
            hm_args = head_major_args(dense_args)
            fn = dense_fn(HEAD_MAJOR, sm_scale)
            ok, err = check(dense_to_rows(fn(*hm_args), data["dense_rows"]), slice(None))
            rec["dense"][HEAD_MAJOR] = {"correct": ok, "max_abs_err": err}
            runs[f"dense:{HEAD_MAJOR}"] = (fn, hm_args)
        except Exception as e:  # noqa: BLE001
            rec["dense"][HEAD_MAJOR] = error_record(e, "correctness")
        update(rec)
    runs = {name: runs[name] for name in timing_order(runs, rec)}
    rec["timing_order"] = list(runs)
    say(f"{op}: timing {len(runs)} runs x {config.repeats} rounds")
    errors: dict = {}
    times = interleaved_rounds(runs, repeats=config.repeats, warmup=config.warmup, errors=errors,
                               calls=calls)  # fmt: skip

    def entry_of(name):
        if name in ("copy", "read"):
            return rec[name]
        return rec["dense"][name[6:]] if name.startswith("dense:") else rec["impls"][name]

    for name, e in errors.items():
        entry_of(name).update(e)
        say(f"{op}: {name} timing ERROR {e['error'][:300]}")
    for name, ts in times.items():
        median = float(np.median(ts))
        entry = entry_of(name)
        ms = spread(1e3 * np.asarray(ts))
        entry.update(median_ms=ms["median"], min_ms=ms["min"], max_ms=ms["max"], iqr_ms=ms["iqr"],
                     rounds=len(ts), round_ms=[1e3 * t for t in ts])  # fmt: skip
        if name in ("copy", "read"):
            entry["gbps"] = entry["bytes"] / median / 1e9  # copy: read + write; read: read only
            entry["fraction_of_peak"] = entry["gbps"] / peak_gbps
            entry["frac_of_datasheet"] = entry["gbps"] / datasheet
        elif not name.startswith("dense:"):
            entry["achieved_gbps"] = data["bytes"] / median / 1e9
            entry["fraction_of_peak"] = entry["achieved_gbps"] / peak_gbps
    copy_gbps, read_gbps = rec["copy"].get("gbps"), rec["read"].get("gbps")
    if copy_gbps and read_gbps:
        rec["copy"]["frac_of_read_roofline"] = copy_gbps / read_gbps
    for name, entry in rec["impls"].items():
        if copy_gbps and "achieved_gbps" in entry:
            entry["fraction_of_copy"] = entry["achieved_gbps"] / copy_gbps
        roofline_fractions(entry, read_gbps=read_gbps, copy_gbps=copy_gbps,
                           datasheet_gbps=datasheet)  # fmt: skip
        baselines = [("ratio_to_dense", entry.get("dense_impl"))]
        if entry.get("dense_impl") == "xla":
            baselines.append(("ratio_to_dense_head_major", HEAD_MAJOR))
        for key, dense in baselines:
            if name in times and f"dense:{dense}" in times:
                ratios = per_round_ratios(times[name], times[f"dense:{dense}"])
                entry[key] = ratios["median"]  # the median of per-round ratios: the headline
                entry[f"{key}_rounds"] = ratios
    update(rec)
    return rec


def kv_key(op: str, kv_cache_dtype: str) -> str:
    """The record key of ``op`` on a quantized pool: ``"decode@int8"``; "auto" is ``op`` itself."""
    return op if kv_cache_dtype == "auto" else f"{op}@{kv_cache_dtype}"


def kv_summary(record: dict, op: str, kv_cache_dtypes) -> dict:
    """Per implementation and KV dtype ("auto" = the model dtype): bytes moved at that dtype's own
    byte count (values + scales + q + out), median ms, achieved GB/s, the fraction of the read-only
    roofline measured on that dtype's own pool, and the time over the "auto" run's time (separate
    timing rounds, not interleaved: read it as a rough ratio)."""
    out: dict = {}
    for kv in ("auto", *kv_cache_dtypes):
        rec = record.get(kv_key(op, kv), {})
        for impl, r in rec.get("impls", {}).items():
            if "median_ms" not in r:
                continue
            row = {"bytes": rec["bytes"], "median_ms": r["median_ms"],
                   "achieved_gbps": r["achieved_gbps"], "correct": r.get("correct"),
                   "frac_of_read_roofline": r.get("frac_of_read_roofline")}  # fmt: skip
            auto = out.get(impl, {}).get("auto")
            if auto:
                row["time_vs_auto"] = r["median_ms"] / auto["median_ms"]
                row["bytes_vs_auto"] = rec["bytes"] / auto["bytes"]
            out.setdefault(impl, {})[kv] = row
    return out


TARGET_STATISTIC = (
    "median over the timing rounds of the per-round ratio paged_ms / dense_ms (ratio_to_dense; "
    "both sides timed back to back in every round, see interleaved_rounds)"
)


def target_record(record: dict, config) -> dict | None:
    """The variant's speed target (``config.target_*``) checked against ``record``; None if it
    has none. The ratio is ``ratio_to_dense``, the median of the per-round ratios."""
    limit = config.get("target_max_ratio", 0.0)
    if not limit:
        return None
    op, impl = config.target_op, config.target_impl
    rec = {"claim": f"paged {impl} {op} <= {limit}x dense contiguous {op}", "op": op,
           "impl": impl, "max_ratio": limit, "statistic": TARGET_STATISTIC}  # fmt: skip
    entry = record.get(op, {}).get("impls", {}).get(impl, {})
    if "ratio_to_dense" not in entry:
        return {**rec, "met": None, "error": f"no ratio_to_dense for {op}:{impl}"}
    spread_ = entry["ratio_to_dense_rounds"]
    return {**rec, "ratio": entry["ratio_to_dense"], "met": entry["ratio_to_dense"] <= limit,
            "ratio_min": spread_["min"], "ratio_max": spread_["max"], "ratio_iqr": spread_["iqr"],
            "rounds": spread_["rounds"]}  # fmt: skip



# ---- the decode grid: many shapes, data made on the device, our kernel vs JAX's on each ----------


def grid_shapes(config) -> list[tuple[str, int, int]]:
    """``(dtype, context, batch)`` of every point of ``config.decode_grid`` (dtypes, then contexts,
    then batches, in the order given: the cheap shapes of the first dtype come first)."""
    g = config.decode_grid
    return [(d, c, b) for d in g.dtypes for c in g.contexts for b in g.batches]


def grid_splits(config, batch: int, context: int) -> tuple[int, int]:
    """The decode kernel's ``(k_splits, pages_per_compute_block)`` at a grid point: the
    :func:`pallas_kernels.gpu_tuning.decode_splits` heuristic on the device's SM count, or the
    config's ``gpu_k_splits`` / ``gpu_pages_per_compute_block`` where ``decode_grid.use_heuristic``
    is False."""
    from pallas_kernels import gpu_tuning

    h = config.heads
    if not config.decode_grid.use_heuristic:
        return config.gpu_k_splits, config.gpu_pages_per_compute_block
    return gpu_tuning.decode_splits(batch, h.num_kv_heads, context, config.page_size,
                                    gpu_tuning.device_sms())  # fmt: skip


def build_decode_on_device(config, dtype: str, batch: int, context: int, seed: int) -> dict:
    """Decode data generated on the device (host RNG would take minutes for the GBs of the large
    grid points): ``batch`` sequences of ``context`` keys, pages shuffled over a pool of
    ``batch * pages_per_seq + extra_pages`` pages, standard normal K/V and q in ``dtype``."""
    h, page = config.heads, config.page_size
    pps = -(-context // page)
    num_pages = batch * pps + config.extra_pages
    jdtype = jnp.dtype(dtype)

    @jax.jit
    def make(key):
        kk, kv, kq, kp = jax.random.split(key, 4)
        shape = (h.num_kv_heads, num_pages, page, h.head_dim)
        k = jax.random.normal(kk, shape, jnp.float32).astype(jdtype)
        v = jax.random.normal(kv, shape, jnp.float32).astype(jdtype)
        q = jax.random.normal(kq, (batch, h.num_q_heads, h.head_dim), jnp.float32).astype(jdtype)
        table = jax.random.permutation(kp, num_pages)[: batch * pps].reshape(batch, pps)
        return q, k, v, jnp.full((batch,), context, jnp.int32), table.astype(jnp.int32)

    args = jax.block_until_ready(make(jax.random.PRNGKey(seed)))
    size = jdtype.itemsize
    return {"args": args, "bytes": 2 * batch * context * h.num_kv_heads * h.head_dim * size
            + 2 * batch * h.num_q_heads * h.head_dim * size}  # fmt: skip


def grid_spot_check(args, seqs, sm_scale: float) -> np.ndarray:
    """float64 numpy decode attention of sequences ``seqs``, fetching only their pages."""
    q, k, v, lengths, table = args
    rows = np.asarray(seqs, np.intp)
    tab = np.asarray(table)[rows]
    k_seq, v_seq = (np.asarray(x[:, tab.reshape(-1)]) for x in (k, v))  # [Hkv, n*pps, page, D]
    local = np.arange(tab.size, dtype=np.int32).reshape(tab.shape)
    return testing.paged_attention_np(np.asarray(q)[rows], k_seq, v_seq, np.asarray(lengths)[rows],
                                      local, sm_scale=sm_scale)  # fmt: skip


def grid_fn(impl: str, config, splits: int, ppb: int, sm_scale: float) -> Callable:
    """One grid implementation with the grid point's splits: ours (``pallas_gpu`` /
    ``interpret_gpu`` with explicit ``k_splits`` / ``pages_per_compute_block``, the same values
    the dispatcher's heuristic would pick), JAX's (``jax_gpu`` / ``jax_gpu_interpret``, given the
    same values), or any other ``pallas_kernels`` impl with its bench config."""
    name, _ = split_variant(impl)
    if name.startswith("jax_gpu"):
        sub = config.copy_and_resolve_references()
        with sub.unlocked():
            sub.gpu_k_splits, sub.gpu_pages_per_compute_block = splits, ppb
        return jax_paged_fn(name, sub, sm_scale)
    if name in ("pallas_gpu", "interpret_gpu"):
        cfg = GpuPagedConfig(k_splits=splits, pages_per_compute_block=ppb,
                             masked_gather=not impl.endswith("@unmasked"))  # fmt: skip
        return jax.jit(lambda *a: pk.paged_attention(*a, sm_scale=sm_scale, impl=name, config=cfg))
    return paged_fn("decode", impl, config, sm_scale)


def bench_grid_point(config, dtype: str, context: int, batch: int, *, datasheet_gbps: float,
                     seed: int, progress=None) -> dict:  # fmt: skip
    """One grid point: data on the device, each of ``decode_grid.impls`` checked (float64 spot
    check of the first and last sequence, plus agreement with the first implementation), then the
    read-only reduction, the copy and every implementation timed in ``decode_grid.repeats``
    interleaved rounds. Each timing queues enough back-to-back calls to last about
    ``decode_grid.min_timing_ms`` (at most ``calls_per_round``), from a quick first timing."""
    say = progress or (lambda msg: None)
    g = config.decode_grid
    h = config.heads
    sm_scale = h.head_dim**-0.5
    splits, ppb = grid_splits(config, batch, context)
    rec = {"dtype": dtype, "context": context, "batch": batch, "k_splits": splits,
           "pages_per_compute_block": ppb, "ctas": batch * h.num_kv_heads * splits,
           "impls": {}}  # fmt: skip
    t0 = time.perf_counter()
    data = build_decode_on_device(config, dtype, batch, context, seed)
    args = data["args"]
    rec["bytes"], rec["build_s"] = data["bytes"], time.perf_counter() - t0
    pool_bytes = int(args[1].nbytes + args[2].nbytes)
    rec["pool_bytes"] = pool_bytes
    rtol = atol = 2e-2 if dtype == "bfloat16" else config.atol
    seqs = sorted({0, batch - 1})
    want = grid_spot_check(args, seqs, sm_scale)
    runs, first_out = {}, None
    base = [("read", read_fn(), (args[1], args[2]), pool_bytes),
            ("copy", copy_fn(), (args[1], args[2], jnp.zeros((), args[1].dtype)), 2 * pool_bytes)]
    for name, fn, a, nbytes in base:
        try:
            jax.block_until_ready(fn(*a))
            runs[name] = (fn, a)
            rec[name] = {"bytes": nbytes}
        except Exception as e:  # noqa: BLE001
            rec[name] = error_record(e, "correctness")
    for impl in g.impls:
        t1 = time.perf_counter()
        try:
            fn = grid_fn(impl, config, splits, ppb, sm_scale)
            out = jax.block_until_ready(fn(*args))
            got = np.asarray(out[np.asarray(seqs)], np.float64)
            err = float(np.max(np.abs(got - want)))
            ok = bool(np.all(np.isfinite(got))) and np.allclose(got, want, rtol=rtol, atol=atol)
            entry = {"correct": ok, "max_abs_err": err, "first_call_s": time.perf_counter() - t1}
            if first_out is None:
                first_out = (impl, out)
            else:
                entry[f"max_abs_diff_vs_{first_out[0]}"] = float(jnp.max(jnp.abs(
                    out.astype(jnp.float32) - first_out[1].astype(jnp.float32))))
            rec["impls"][impl] = entry
            runs[impl] = (fn, args)
        except Exception as e:  # noqa: BLE001
            rec["impls"][impl] = {**error_record(e, "correctness"),
                                  "first_call_s": time.perf_counter() - t1}  # fmt: skip
            say(f"grid {dtype} ctx={context} B={batch}: {impl} ERROR {str(e)[:200]}")
    del first_out
    errors: dict = {}
    calls = {}
    for name, (fn, a) in runs.items():  # one quick timing each, to size the back-to-back calls
        try:
            dt = _timed(fn, a, 1)
            calls[name] = int(min(config.calls_per_round,
                                  max(1, np.ceil(g.min_timing_ms / 1e3 / max(dt, 1e-9)))))
        except Exception as e:  # noqa: BLE001
            errors[name] = error_record(e, "timing")
    runs = {n: r for n, r in runs.items() if n not in errors}
    times = {}
    for r in range(g.repeats):  # interleaved, alternating order, like interleaved_rounds
        for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            if name in errors:
                continue
            try:
                times.setdefault(name, []).append(_timed(*runs[name], calls[name]))
            except Exception as e:  # noqa: BLE001
                errors[name] = error_record(e, "timing")
    for name, e in errors.items():
        (rec[name] if name in ("read", "copy") else rec["impls"][name]).update(e)
    for name, ts in times.items():
        if name in errors:
            continue
        entry = rec[name] if name in ("read", "copy") else rec["impls"][name]
        median = float(np.median(ts))
        entry.update(median_ms=1e3 * median, min_ms=1e3 * float(np.min(ts)), calls=calls[name],
                     rounds=len(ts))  # fmt: skip
        if name in ("read", "copy"):
            entry["gbps"] = entry["bytes"] / median / 1e9
            entry["frac_of_datasheet"] = entry["gbps"] / datasheet_gbps
        else:
            entry["achieved_gbps"] = rec["bytes"] / median / 1e9
    read_gbps, copy_gbps = rec["read"].get("gbps"), rec["copy"].get("gbps")
    ref = rec["impls"].get(g.compare_to, {}).get("median_ms")
    for entry in rec["impls"].values():
        roofline_fractions(entry, read_gbps=read_gbps, copy_gbps=copy_gbps,
                           datasheet_gbps=datasheet_gbps)  # fmt: skip
        if ref and "median_ms" in entry:
            entry[f"speedup_vs_{g.compare_to}"] = ref / entry["median_ms"]
    rec["point_s"] = time.perf_counter() - t0
    del data, args, runs
    return rec


def bench_grid(config, *, peak_gbps: float, on_update=None, progress=None) -> dict:
    """Every point of :func:`grid_shapes` (:func:`bench_grid_point`), one after the other, each
    point's failure recorded and the rest going on; ``on_update(rec)`` after every point."""
    say = progress or (lambda msg: None)
    update = on_update or (lambda rec: None)
    datasheet = float(config.get("datasheet_gbps", 0.0) or peak_gbps)
    rec = {"points": [], "datasheet_gbps": datasheet,
           "shapes": [list(s) for s in grid_shapes(config)],
           "heuristic": "pallas_kernels.gpu_tuning.decode_splits"
           if config.decode_grid.use_heuristic else "config"}  # fmt: skip
    for i, (dtype, context, batch) in enumerate(grid_shapes(config)):
        t0 = time.perf_counter()
        try:
            point = bench_grid_point(config, dtype, context, batch, datasheet_gbps=datasheet,
                                     seed=config.seed + i, progress=say)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: the next point may still fit
            point = {"dtype": dtype, "context": context, "batch": batch, "impls": {},
                     **error_record(e, "point")}  # fmt: skip
        point.setdefault("point_s", time.perf_counter() - t0)
        rec["points"].append(point)
        say("grid " + grid_line(point))
        update(rec)
    return rec


def grid_line(p: dict) -> str:
    """One line per grid point for logs and the device-check summary."""
    head = (f"{p['dtype']:>8} ctx={p['context']:>5} B={p['batch']:>3} splits={p.get('k_splits')} "
            f"ppb={p.get('pages_per_compute_block')} ({p.get('point_s', 0):.1f}s)")  # fmt: skip
    if "error" in p:
        return head + f" POINT ERROR {p['error'][:200]}"
    parts = [head]
    for name in ("read", "copy"):
        r = p.get(name, {})
        parts.append(f"{name} {r['gbps']:.0f} GB/s" if "gbps" in r else f"{name} n/a")
    for name, r in p.get("impls", {}).items():
        if "error" in r:
            parts.append(f"{name} ERROR [{r.get('error_stage')}] {r['error'][:150]}")
            continue
        s = f"{name} ok={r.get('correct')}"
        if "median_ms" in r:
            s += (f" {r['median_ms']:.4f} ms {r['achieved_gbps']:.0f} GB/s "
                  f"{100 * r.get('frac_of_read_roofline', float('nan')):.0f}%read "
                  f"{100 * r.get('frac_of_copy', float('nan')):.0f}%copy")  # fmt: skip
        for k, val in r.items():
            if k.startswith("speedup_vs_") and name != k[len("speedup_vs_"):]:
                s += f" x{val:.2f} vs {k[len('speedup_vs_'):]}"
        parts.append(s)
    return " | ".join(parts)
