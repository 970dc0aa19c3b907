"""Tests for paged/accounting.py: hand-computed formulas, the seed's table, ledger invariants."""

from __future__ import annotations

import dataclasses
import json
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged import accounting
from paged.accounting import MemoryLedger, ModelSpec

SEED_LENGTHS = [37, 91, 128, 201, 511]


# ----------------------------------------------------------------------------- formulas


def test_kv_bytes_hand_computed():
    # Llama-2-7B-like: 32 layers, 32 KV heads, d=128, bf16 -> 512 KiB per token.
    assert accounting.kv_bytes(32, 1, 32, 128, 2) == 2 * 32 * 32 * 128 * 2 == 524288
    # GQA with 8 KV heads is 4x smaller for the same token count: size is not a parameter count.
    assert accounting.kv_bytes(32, 1000, 8, 128, 2) == 131072000
    assert accounting.kv_bytes(2, 0, 1, 4, 4) == 0


@pytest.mark.parametrize(
    "n, block_size, blocks, allocated, waste",
    [
        (0, 16, 0, 0, 0),
        (1, 16, 1, 16, 15),
        (16, 16, 1, 16, 0),
        (17, 16, 2, 32, 15),
        (37, 16, 3, 48, 11),
        (37, 32, 2, 64, 27),
        (201, 16, 13, 208, 7),
        (201, 32, 7, 224, 23),
        (511, 32, 16, 512, 1),
        (5, 1, 5, 5, 0),
    ],
)
def test_allocated_positions_and_tail_waste(n, block_size, blocks, allocated, waste):
    assert accounting.blocks_needed(n, block_size) == blocks
    assert accounting.allocated_positions(n, block_size) == allocated
    assert accounting.tail_waste(n, block_size) == waste


def test_exact_for_huge_lengths():
    # Integer ceil: float division would round 2**60 + 1 down.
    assert accounting.allocated_positions(2**60 + 1, 2) == 2**60 + 2


def test_seed_table():
    assert sum(SEED_LENGTHS) == 968
    assert len(SEED_LENGTHS) * 512 == 2560
    assert sum(accounting.allocated_positions(n, 16) for n in SEED_LENGTHS) == 992
    assert sum(accounting.allocated_positions(n, 32) for n in SEED_LENGTHS) == 1024
    fixed = accounting.position_utilization(SEED_LENGTHS, max_len=512)
    p16 = accounting.position_utilization(SEED_LENGTHS, block_size=16)
    p32 = accounting.position_utilization(SEED_LENGTHS, block_size=32)
    assert fixed == 968 / 2560 and p16 == 968 / 992 and p32 == 968 / 1024
    assert [round(100 * u, 2) for u in (fixed, p16, p32)] == [37.81, 97.58, 94.53]


def test_position_utilization_accepts_numpy():
    assert accounting.position_utilization(np.array(SEED_LENGTHS), block_size=np.int32(16)) == (
        968 / 992
    )


def test_reservation_waste_and_block_table_bytes():
    assert accounting.reservation_waste(37, 512) == 475
    assert accounting.reservation_waste(512, 512) == 0
    assert accounting.block_table_bytes(5, 32) == 640
    assert accounting.block_table_bytes(5, 16, bytes_per_entry=8) == 640
    assert accounting.block_table_bytes(0, 16) == 0


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: accounting.allocated_positions(-1, 16), ValueError, "n=-1"),
        (lambda: accounting.tail_waste(5, 0), ValueError, "block_size=0 must be a positive"),
        (lambda: accounting.tail_waste(5, -4), ValueError, "block_size=-4"),
        (lambda: accounting.allocated_positions(5, 2.0), TypeError, "block_size=2.0"),
        (lambda: accounting.allocated_positions(1.5, 2), TypeError, "n=1.5"),
        (lambda: accounting.allocated_positions(True, 2), TypeError, "n=True"),
        (lambda: accounting.kv_bytes(0, 1, 1, 1, 2), ValueError, "num_layers=0"),
        (lambda: accounting.kv_bytes(1, -1, 1, 1, 2), ValueError, "num_tokens=-1"),
        (lambda: accounting.reservation_waste(513, 512), ValueError, "n=513 exceeds max_len=512"),
        (lambda: accounting.position_utilization([], block_size=16), ValueError, r"lengths=\[\]"),
        (lambda: accounting.position_utilization([1, -2], block_size=16), ValueError, "-2"),
        (lambda: accounting.position_utilization([1, 600], max_len=512), ValueError, "n=600"),
        (lambda: accounting.position_utilization([1]), ValueError, "exactly one"),
        (
            lambda: accounting.position_utilization([1], block_size=16, max_len=512),
            ValueError,
            "exactly one",
        ),
        (lambda: accounting.position_utilization([0, 0], block_size=16), ValueError, "0/0"),
        (lambda: accounting.position_utilization([1, "2"], block_size=16), TypeError, "'2'"),
        (lambda: accounting.position_utilization("12", block_size=16), TypeError, "lengths"),
        (lambda: accounting.position_utilization(7, block_size=16), TypeError, "lengths=7"),
        (lambda: accounting.block_table_bytes(-1, 4), ValueError, "num_seqs=-1"),
    ],
)
def test_errors_name_the_value(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 10**6), block_size=st.integers(1, 1024))
def test_tail_waste_bounds(n, block_size):
    waste = accounting.tail_waste(n, block_size)
    assert 0 <= waste <= block_size - 1
    assert accounting.allocated_positions(n, block_size) % block_size == 0


# ----------------------------------------------------------------------------- ModelSpec


def test_model_spec_bytes():
    spec = ModelSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    assert spec.bytes_per_scalar == 2
    assert spec.bytes_per_token == accounting.kv_bytes(32, 1, 8, 128, 2) == 131072
    assert spec.bytes_per_block(16) == 16 * 131072
    assert ModelSpec(1, 1, 4, "float32").bytes_per_token == 32
    assert ModelSpec(1, 1, 4, np.float16).dtype == "float16"


def test_model_spec_from_config():
    cfg = types.SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", x=1)
    spec = ModelSpec.from_model_config(cfg)
    assert spec == ModelSpec(2, 2, 16, "float32")
    assert ModelSpec.from_model_config(cfg, dtype="bfloat16").bytes_per_scalar == 2
    with pytest.raises(TypeError, match="head_dim"):
        ModelSpec.from_model_config(types.SimpleNamespace(num_layers=2, num_kv_heads=2))


def test_model_spec_is_frozen_and_validated():
    spec = ModelSpec(1, 1, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_layers = 3
    with pytest.raises(ValueError, match="num_kv_heads=0"):
        ModelSpec(1, 0, 4)
    with pytest.raises(TypeError, match="dtype='nope'"):
        ModelSpec(1, 1, 4, "nope")


# ----------------------------------------------------------------------------- ledger

# 2 (K and V) * 2 layers * 2 heads * head_dim 2 * 4 bytes = 64 B per token.
SPEC = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=2, dtype="float32")


def test_staged_positions_leave_effective_kv():
    kw = dict(used=[(1, 4), (1, 1), (3, 2)], cached_free=2, free=3, reserved=1)
    base = MemoryLedger.from_blocks(SPEC, 4, 10, **kw)
    ledger = MemoryLedger.from_blocks(SPEC, 4, 10, staged_positions=3, **kw)
    assert ledger.staged == 3 * 64 and ledger.effective_kv == base.effective_kv - 3 * 64
    assert sum(ledger.categories().values()) == ledger.pool_bytes
    with pytest.raises(ValueError, match="staged_positions"):
        MemoryLedger.from_blocks(SPEC, 4, 10, staged_positions=6, **kw)  # more than owned


def test_ledger_hand_computed():
    # 10 blocks of 4 positions (256 B each): null page, 3 in use, 2 cached, 3 free, 1 quarantined.
    ledger = MemoryLedger.from_blocks(
        SPEC,
        4,
        10,
        used=[(1, 4), (1, 1), (3, 2)],
        cached_free=2,
        free=3,
        reserved=1,
        block_table_bytes=48,
        workspace_bytes=100,
    )
    assert SPEC.bytes_per_token == 64 and SPEC.bytes_per_block(4) == 256
    assert ledger.categories() == {
        "effective_kv": 5 * 64,
        "staged": 0,  # no speculative positions in flight
        "shared": 2 * 64,
        "tail_fragmentation": (12 - 7) * 64,
        "cached_free": 2 * 256,
        "free": 3 * 256,
        "null_page": 256,
        "reserved": 256,
        "transfer": 0,  # no pages held for a hand-over between replicas
        "scales": 0,  # an unquantized pool has none
        "page_metadata": 0,  # no page key bounds without sparse decode
    }
    assert ledger.pool_bytes == 2560 == sum(ledger.categories().values())
    assert ledger.shared_saved_bytes == 2 * 2 * 64
    assert ledger.position_utilization == 7 / 12
    d = ledger.as_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["pool_bytes"] == 2560 and d["total_bytes"] == 2560 + 48 + 100
    assert d["side_costs"] == {"block_table_bytes": 48, "workspace_bytes": 100}
    assert d["position_utilization"] == 7 / 12


def test_ledger_empty_pool():
    ledger = MemoryLedger.from_blocks(SPEC, 4, 5, used=[], cached_free=0, free=4)
    assert ledger.position_utilization is None
    assert ledger.categories()["free"] == 4 * 256 and ledger.null_page == 256


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(used=[(1, 4)], cached_free=0, free=3), ValueError, "num_blocks=4 but"),
        (dict(used=[(1, 5)], cached_free=0, free=2), ValueError, "filled_slots=5 exceeds"),
        (dict(used=[(0, 1)], cached_free=0, free=2), ValueError, "refcount=0"),
        (dict(used=[(1, -1)], cached_free=0, free=2), ValueError, "filled_slots=-1"),
        (dict(used=[(1,)], cached_free=0, free=2), TypeError, r"used\[0\]"),
        (dict(used=[], cached_free=-1, free=4), ValueError, "cached_free=-1"),
        (dict(used=[], cached_free=0, free=3.0), TypeError, "free=3.0"),
    ],
)
def test_ledger_rejects_bad_counts(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        MemoryLedger.from_blocks(SPEC, 4, 4, **kwargs)


def test_ledger_constructor_checks_the_sum():
    ledger = MemoryLedger.from_blocks(SPEC, 4, 2, used=[], cached_free=0, free=1)
    with pytest.raises(ValueError, match="sum to"):
        dataclasses.replace(ledger, free=0)


def test_reservation_ledger_seed_example():
    ledger = MemoryLedger.for_reservation(SPEC, 512, SEED_LENGTHS, num_slots=8)
    assert ledger.effective_kv == 968 * 64
    assert ledger.tail_fragmentation == (2560 - 968) * 64
    assert ledger.free == 3 * 512 * 64
    assert ledger.null_page == ledger.shared == ledger.cached_free == 0
    assert ledger.pool_bytes == 8 * 512 * 64
    assert ledger.position_utilization == accounting.position_utilization(SEED_LENGTHS, max_len=512)


def test_reservation_ledger_errors():
    with pytest.raises(ValueError, match="num_slots=1"):
        MemoryLedger.for_reservation(SPEC, 512, [1, 2], num_slots=1)
    with pytest.raises(ValueError, match="n=513 exceeds max_len=512"):
        MemoryLedger.for_reservation(SPEC, 512, [513], num_slots=1)
    assert MemoryLedger.for_reservation(SPEC, 512, [], num_slots=2).free == 2 * 512 * 64


def test_paged_ledger_matches_formula_on_seed_lengths():
    # One sequence per block chain, nothing shared: the ledger reproduces A_B and U.
    used = []
    for n in SEED_LENGTHS:
        full, rest = divmod(n, 16)
        used += [(1, 16)] * full + ([(1, rest)] if rest else [])
    ledger = MemoryLedger.from_blocks(SPEC, 16, len(used) + 1, used=used, cached_free=0, free=0)
    assert len(used) == 62
    assert ledger.tail_fragmentation == (992 - 968) * 64
    assert ledger.position_utilization == accounting.position_utilization(
        SEED_LENGTHS, block_size=16
    )


@st.composite
def _pools(draw):
    block_size = draw(st.integers(1, 64))
    used = draw(st.lists(st.tuples(st.integers(1, 8), st.integers(0, block_size)), max_size=30))
    cached_free, free, reserved = (draw(st.integers(0, 20)) for _ in range(3))
    return block_size, used, cached_free, free, reserved


@settings(max_examples=200, deadline=None)
@given(
    pool=_pools(),
    layers=st.integers(1, 4),
    heads=st.integers(1, 4),
    dtype=st.sampled_from(["float32", "bfloat16", "int8"]),
)
def test_ledger_always_sums_to_pool(pool, layers, heads, dtype):
    block_size, used, cached_free, free, reserved = pool
    spec = ModelSpec(layers, heads, 8, dtype)
    num_blocks = len(used) + cached_free + free + reserved + 1
    ledger = MemoryLedger.from_blocks(
        spec,
        block_size,
        num_blocks,
        used=used,
        cached_free=cached_free,
        free=free,
        reserved=reserved,
    )
    assert sum(ledger.categories().values()) == ledger.pool_bytes
    assert ledger.pool_bytes == num_blocks * spec.bytes_per_block(block_size)
    assert all(v >= 0 for v in ledger.categories().values())
    with pytest.raises(ValueError, match="num_blocks"):
        MemoryLedger.from_blocks(
            spec,
            block_size,
            num_blocks + 1,
            used=used,
            cached_free=cached_free,
            free=free,
            reserved=reserved,
        )


def test_page_bounds_are_page_metadata_in_every_block():
    # Sparse decode's key bounds: min and max rows of D values per layer and KV head, per block.
    spec = dataclasses.replace(SPEC, page_bounds=True)
    assert spec.metadata_bytes_per_block(4) == 2 * 2 * 2 * 2 * 4 == 64
    assert spec.bytes_per_block(4) == SPEC.bytes_per_block(4) + 64
    ledger = MemoryLedger.from_blocks(spec, 4, 5, used=[(1, 3)], cached_free=1, free=2)
    assert ledger.categories()["page_metadata"] == 5 * 64
    assert ledger.pool_bytes == sum(ledger.categories().values())
