"""The CPU engine and the simulator on one time-scaled Mooncake window
(`experiments.cache_agreement`, smoke variant): the simulator fed the engine's measured step times
reproduces its prefix-cache hits exactly, and with its own fitted step model stays within one
percentage point; the short prompts keep the trace's block structure."""

from __future__ import annotations

import json

from experiments import cache_agreement
from experiments.configs import cache_agreement as config
from paged.workload import mooncake_trace


def test_short_prompts_keep_the_chains():
    w = mooncake_trace.load_mooncake_trace("conversation", window=(0.0, 5.0), block=16)
    rows = mooncake_trace.read("conversation")
    for r in w.requests:
        ids = rows.hash_ids[int(r.request_id.rsplit("-", 1)[1])]
        assert 16 * (len(ids) - 1) < r.prompt_len <= 16 * len(ids)
        toks = r.prompt_token_ids
        for j, h in enumerate(ids[:(r.prompt_len - 1) // 16]):  # a block is its id's 16 tokens
            assert toks[16 * j:16 * j + 16] == tuple(
                mooncake_trace.block_tokens([h], 16, 256, 16).tolist())
    assert w.meta["derived"][-1]["block_tokens"] == 16


def test_engine_and_simulator_agree_on_hits(tmp_path):
    c = config.get_config("smoke")
    c.output_dir = str(tmp_path)
    cache_agreement.main(c, cache_agreement.check(c))
    row = json.loads((tmp_path / "cache_agreement.json").read_text())["rows"][0]
    assert row["engine"]["prefix_cache_hit_tokens"] > 0
    assert row["sim_replay"]["prefix_cache_hit_tokens"] == row["engine"]["prefix_cache_hit_tokens"]
    assert row["sim_replay"]["steps"] == row["engine"]["steps"]
    assert abs(row["sim_fitted_gap_pp"]["token_hit_rate"]) <= 1.0
    assert abs(row["sim_fitted_gap_pp"]["block_hit_rate"]) <= 1.0
