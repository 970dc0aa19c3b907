r"""Position fragmentation of fixed reservation vs paging, for a constructed set of lengths.

Reproduces the source document's table: lengths 37, 91, 128, 201, 511 hold 968 valid
positions; a fixed 512 reservation allocates 2560 (37.81%), 16-position pages 992 (97.58%),
32-position pages 1024 (94.53%). These are position counts, not device utilization or throughput,
and say nothing about speed-ups. Block-table bytes (i32, one row of ceil(max_len/B) entries per
sequence) are reported beside, as the seed's table excludes them.

  python -m experiments.fragmentation
  python -m experiments.fragmentation --config.block_sizes=8,16,32,64,128 --config.max_len=512 \
      --config.output_dir=/tmp/frag

Config: experiments/configs/fragmentation.py (``:smoke`` for a small variant). Writes
``fragmentation.json`` to ``config.output_dir`` (default ``results/fragmentation/<UTC timestamp>/``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from experiments import common
from experiments.configs.fragmentation import SEED_LENGTHS
from paged import accounting

_ENTRY_BYTES = 4  # block tables hold i32 page indices


def parse_ints(name: str, values: Sequence[int | str], *, minimum: int) -> list[int]:
    """Integers (or integer strings) ``>= minimum``; raises ValueError naming the bad value."""
    if isinstance(values, (str, int)):
        values = [values]
    if not values:
        raise ValueError(f"{name} is empty")
    out = []
    for text in values:
        try:
            if isinstance(text, bool) or isinstance(text, float):
                raise ValueError
            value = text if isinstance(text, int) else int(str(text).strip())
        except ValueError:
            raise ValueError(f"{name}: {text!r} is not an integer") from None
        if value < minimum:
            raise ValueError(f"{name}: {value} must be an integer >= {minimum}")
        out.append(value)
    return out


def parse_inputs(lengths: Sequence[int | str], block_sizes: Sequence[int | str], max_len: int):
    """Validates the settings; returns ``(lengths, block_sizes, max_len)`` as ints.

    Raises:
      ValueError: a non-integer, a negative length, a non-positive size, or a length > max_len.
    """
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len: {max_len!r} must be an integer >= 1")
    ns = parse_ints("lengths", lengths, minimum=0)
    bs = parse_ints("block_sizes", block_sizes, minimum=1)
    too_long = [n for n in ns if n > max_len]
    if too_long:
        raise ValueError(f"lengths: {too_long} exceed max_len={max_len}")
    return ns, bs, max_len


def layout_rows(lengths: Sequence[int], block_sizes: Sequence[int], max_len: int) -> list[dict]:
    """One summary row per layout: the fixed reservation, then each block size."""
    valid = sum(lengths)
    fixed_alloc = len(lengths) * max_len
    rows = [
        {
            "layout": "fixed",
            "max_len": max_len,
            "block_size": None,
            "valid_positions": valid,
            "allocated_positions": fixed_alloc,
            "wasted_positions": fixed_alloc - valid,
            "position_utilization": accounting.position_utilization(lengths, max_len=max_len),
            "num_blocks": None,
            # A contiguous layout needs no page table, only a base offset per slot.
            "block_table_bytes": 0,
        }
    ]
    for b in block_sizes:
        alloc = sum(accounting.allocated_positions(n, b) for n in lengths)
        rows.append(
            {
                "layout": "paged",
                "max_len": max_len,
                "block_size": b,
                "valid_positions": valid,
                "allocated_positions": alloc,
                "wasted_positions": alloc - valid,
                "position_utilization": accounting.position_utilization(lengths, block_size=b),
                "num_blocks": sum(accounting.blocks_needed(n, b) for n in lengths),
                "block_table_bytes": accounting.block_table_bytes(
                    len(lengths), accounting.blocks_needed(max_len, b), _ENTRY_BYTES
                ),
            }
        )
    return rows


def sequence_rows(lengths: Sequence[int], block_sizes: Sequence[int], max_len: int) -> list[dict]:
    """Per sequence: allocated positions A and waste W for the reservation and each block size."""
    return [
        {
            "n": n,
            "fixed": {"A": max_len, "W": accounting.reservation_waste(n, max_len)},
            "paged": {
                str(b): {
                    "A": accounting.allocated_positions(n, b),
                    "W": accounting.tail_waste(n, b),
                }
                for b in block_sizes
            },
        }
        for n in lengths
    ]


def format_tables(layouts: list[dict], sequences: list[dict], block_sizes: Sequence[int]) -> str:
    """Human-readable tables of ``layout_rows`` and ``sequence_rows``."""
    lines = [
        f"{len(sequences)} sequences, {layouts[0]['valid_positions']} valid positions "
        "(evidence: constructed; position counts, not device utilization)",
        "",
        f"{'layout':<14}{'allocated':>10}{'wasted':>8}{'util':>9}{'blocks':>8}{'table B':>9}",
    ]
    for r in layouts:
        name = f"fixed M={r['max_len']}" if r["layout"] == "fixed" else f"paged B={r['block_size']}"
        blocks = "-" if r["num_blocks"] is None else str(r["num_blocks"])
        lines.append(
            f"{name:<14}{r['allocated_positions']:>10}{r['wasted_positions']:>8}"
            f"{100 * r['position_utilization']:>8.2f}%{blocks:>8}{r['block_table_bytes']:>9}"
        )
    lines += ["", "per sequence, allocated A / waste W:"]
    lines.append(f"{'n':>6}{'fixed':>12}" + "".join(f"{'B=' + str(b):>12}" for b in block_sizes))
    for s in sequences:
        cells = [f"{s['fixed']['A']}/{s['fixed']['W']}"]
        cells += [f"{s['paged'][str(b)]['A']}/{s['paged'][str(b)]['W']}" for b in block_sizes]
        lines.append(f"{s['n']:>6}" + "".join(f"{c:>12}" for c in cells))
    return "\n".join(lines)


#: KV storage formats compared side by side: (column, kv_cache_dtype, scale granularity).
KV_DTYPES = (("model", "auto", "token"), ("int8", "int8", "token"), ("int8/page", "int8", "page"),
             ("fp8", "fp8_e4m3", "token"))


def kv_bytes_rows(layouts: list[dict], spec: accounting.ModelSpec) -> list[dict]:
    """Each layout's allocated and valid positions in KV bytes of ``spec``'s model, and its
    allocated bytes in each of ``KV_DTYPES`` (exact, scales included)."""
    per = spec.bytes_per_token
    rows = []
    for r in layouts:
        page = r["block_size"] or r["max_len"]  # a fixed reservation is one page per request
        by_dtype = {col: accounting.kv_bytes(spec, r["allocated_positions"], kv_cache_dtype=name,
                                             scale_granularity=g, page_size=page)
                    for col, name, g in KV_DTYPES}
        rows.append({"layout": r["layout"], "block_size": r["block_size"],
                     "allocated_bytes": r["allocated_positions"] * per,
                     "valid_bytes": r["valid_positions"] * per,
                     "wasted_bytes": r["wasted_positions"] * per,
                     "allocated_bytes_by_kv_dtype": by_dtype})
    return rows


def format_kv_bytes(kv: dict) -> str:
    """Human-readable table of ``build_report(...)["kv_bytes"]``."""
    m = kv["model"]
    lines = [f"KV bytes for {kv['config']} ({m['num_layers']} layers, {m['num_kv_heads']} KV heads, "
             f"head_dim {m['head_dim']}, {m['dtype']}): {kv['bytes_per_token']} B per token",
             f"{'layout':<14}{'allocated MiB':>15}{'wasted MiB':>12}"
             + "".join(f"{col + ' MiB':>15}" for col, _, _ in KV_DTYPES)]
    for r in kv["layouts"]:
        name = "fixed" if r["layout"] == "fixed" else f"paged B={r['block_size']}"
        by_dtype = r.get("allocated_bytes_by_kv_dtype", {})
        lines.append(f"{name:<14}{r['allocated_bytes'] / 2**20:>15.2f}"
                     f"{r['wasted_bytes'] / 2**20:>12.2f}"
                     + "".join(f"{by_dtype.get(col, 0) / 2**20:>15.2f}" for col, _, _ in KV_DTYPES))
    return "\n".join(lines)


def build_report(lengths: Sequence[int], block_sizes: Sequence[int], max_len: int,
                 spec: accounting.ModelSpec | None = None, model_config: str = "") -> dict:
    """The full JSON-ready report for validated inputs (with ``kv_bytes`` when ``spec`` is given:
    the model read from the Hugging Face ``model_config``)."""
    report = {
        "study": "fragmentation",
        # Hand-given lengths (by default the seed document's example), never a measured workload.
        "evidence": "constructed",
        "seed_example": tuple(lengths) == SEED_LENGTHS,
        "inputs": {"lengths": list(lengths), "block_sizes": list(block_sizes), "max_len": max_len},
        "layouts": layout_rows(lengths, block_sizes, max_len),
        "sequences": sequence_rows(lengths, block_sizes, max_len),
        "provenance": {"numpy": np.__version__},  # completed by common.write_result
    }
    if spec is not None:
        report["kv_bytes"] = {
            "config": model_config, "model": dataclasses.asdict(spec),
            "bytes_per_token": spec.bytes_per_token,
            "layouts": kv_bytes_rows(report["layouts"], spec),
        }
    return report


def check(c) -> tuple:
    spec = None
    if c.get("model_config"):
        spec = accounting.ModelSpec.from_hf_config(c.model_config, dtype=c.get("model_dtype") or None)
    return (*parse_inputs(c.lengths, c.block_sizes, c.max_len), spec)


def main(c, plan) -> None:
    lengths, block_sizes, max_len, spec = plan
    report = build_report(lengths, block_sizes, max_len, spec, c.get("model_config", ""))
    print(format_tables(report["layouts"], report["sequences"], block_sizes))
    if spec is not None:
        print("\n" + format_kv_bytes(report["kv_bytes"]))
    path = common.write_result(common.output_dir(c, "fragmentation") / "fragmentation.json", report)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    common.run("fragmentation", main, check)
