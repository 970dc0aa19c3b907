"""block_size_sweep's bytes per KV dtype side by side (fragmentation's helper), exact."""

from experiments.block_size_sweep import formula_metrics, kv_bytes_by_dtype
from paged.accounting import ModelSpec


def test_kv_bytes_by_dtype_exact():
    spec = ModelSpec(num_layers=2, num_kv_heads=4, head_dim=16, dtype="bfloat16")
    lengths, b = [5, 17, 32], 16  # allocated 16 + 32 + 32 = 80 positions, 5 pages
    f = formula_metrics(lengths, b, spec.bytes_per_token)
    assert f["allocated_positions"] == 80
    got = kv_bytes_by_dtype(f, b, spec)
    per = 2 * 2 * 4  # 2 (K, V) * L * h_kv: bytes of one scale slot / elements per position / D
    assert got == {"model": 80 * per * 16 * 2, "int8": 80 * per * (16 + 4),
                   "int8/page": 80 * per * 16 + 5 * per * 4, "fp8": 80 * per * (16 + 4)}
