"""Tests for paged.workload.mooncake_trace: the shipped files, the README figures, and token ids
built from block ids (equal ids give equal tokens, different ids differ, partial last blocks)."""

import hashlib
import json

import numpy as np
import pytest

from paged.workload import check_same_evidence
from paged.workload import mooncake_trace as mt


@pytest.mark.parametrize("name,count,reuse", [("conversation", 12031, 0.366),
                                               ("synthetic", 3993, 0.640)])
def test_counts_and_infinite_cache_reuse_match_the_source_readme(name, count, reuse):
    rows = mt.read(name)
    assert len(rows.input_lens) == count
    assert round(mt.block_reuse(rows.hash_ids), 3) == reuse  # README-source.md: 36.6 % / 64.0 %
    source = (mt.TRACE_DIR / mt.TRACES[name]).read_bytes()
    assert rows.sha256 == hashlib.sha256(source).hexdigest()


def test_tokens_follow_block_ids_exactly():
    w = mt.load_mooncake_trace("conversation", window=(0, 40))
    rows = mt.read("conversation")
    assert w.evidence == "real" and check_same_evidence([w]) == "real"
    assert [d["name"] for d in w.meta["derived"]] == ["window", "tokens_from_block_ids"]
    assert "block ids" in w.label() and w.meta["licence"] == "Apache-2.0"
    content: dict[int, tuple] = {}
    seen_ids, seen_tokens, id_hits, token_hits = set(), set(), 0, 0
    for r in w.requests:
        ids = rows.hash_ids[int(r.request_id.split("-")[1])]
        toks = r.prompt_token_ids
        assert len(toks) == r.prompt_len and max(toks) < 256
        for i, h in enumerate(ids):
            chunk = toks[i * 512:(i + 1) * 512]
            assert 0 < len(chunk) <= 512 and (len(chunk) == 512 or i == len(ids) - 1)
            full = content.setdefault(h, chunk)
            n = min(len(full), len(chunk))
            assert full[:n] == chunk[:n]  # equal ids: equal tokens (a partial block: a prefix)
            if len(chunk) > len(full):
                content[h] = chunk
            if len(chunk) == 512:
                id_hits += h in seen_ids
                token_hits += chunk in seen_tokens
        seen_ids.update(ids)
        seen_tokens.update(toks[i * 512:(i + 1) * 512] for i in range(len(ids)))
    heads = {c[:3] for c in content.values()}
    assert len(heads) == len(content)  # different ids: different first tokens
    assert token_hits == id_hits > 0  # reuse by content = reuse by id (full blocks)


def test_block_tokens_partial_last_block_and_digits():
    t = mt.block_tokens([5, 70000], 600, 256)
    assert t.shape == (600,) and t[:3].tolist() == [5, 0, 0]
    assert t[512:515].tolist() == [70000 % 256, (70000 // 256) % 256, 70000 // 65536]
    assert np.array_equal(mt.block_tokens([5], 512, 256), t[:512])


@pytest.mark.parametrize("bad,match", [({"name": "chat"}, "must be one of"),
                                       ({"name": "synthetic", "vocab": 16}, "vocab"),
                                       ({"name": "synthetic", "window": (5, 1)}, "end_s")])
def test_bad_arguments_are_one_clear_error(bad, match):
    with pytest.raises(ValueError, match=match):
        mt.load_mooncake_trace(**bad)


def test_malformed_row_names_its_line(tmp_path):
    p = tmp_path / "t.jsonl"
    good = {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}
    p.write_text(json.dumps(good) + "\n" + json.dumps({**good, "input_length": 1100}) + "\n")
    with pytest.raises(ValueError, match=r"t.jsonl:2: input_length=1100"):
        mt.read("synthetic", p)
