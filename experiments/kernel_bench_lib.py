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
from pallas_kernels import testing, xla
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
    cannot fold away): the device's copy bandwidth on the very buffers the kernels read."""
    return jax.jit(lambda k, v, z: (k + z, v + z))


def timing_order(runs: dict, rec: dict) -> list[str]:
    """The order of :func:`interleaved_rounds`: the copy, then each implementation between its
    dense baseline (before it) and, for the "xla" family, the head-major baseline (after it), so
    every ratio's two sides are neighbours."""
    order = ["copy"] if "copy" in runs else []
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
) -> dict:
    """Checks then times ``impls`` on ``data``; returns the op's JSON record.

    Every failure (lowering, compile, run, numerics) is recorded under the implementation it
    belongs to and the others go on. ``on_update(rec)`` is called with the partial record after
    each step (so a caller can write it out before a timeout); ``progress`` gets one-line notes.
    """
    say = progress or (lambda msg: None)
    update = on_update or (lambda rec: None)
    sm_scale = config.heads.head_dim**-0.5
    rec = {"shape": data["shape"], "bytes": data["bytes"], "impls": {}, "dense": {}}
    t0 = time.perf_counter()
    args = tuple(jnp.asarray(a) for a in data["args"])
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
        if d in rec["dense"]:
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
    if config.dense_head_major and "correct" in rec["dense"].get("xla", {}):
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
        if name == "copy":
            return rec["copy"]
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
        if name == "copy":
            entry["gbps"] = entry["bytes"] / median / 1e9  # read + write
            entry["fraction_of_peak"] = entry["gbps"] / peak_gbps
        elif not name.startswith("dense:"):
            entry["achieved_gbps"] = data["bytes"] / median / 1e9
            entry["fraction_of_peak"] = entry["achieved_gbps"] / peak_gbps
    copy_gbps = rec["copy"].get("gbps")
    for name, entry in rec["impls"].items():
        if copy_gbps and "achieved_gbps" in entry:
            entry["fraction_of_copy"] = entry["achieved_gbps"] / copy_gbps
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

