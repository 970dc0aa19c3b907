"""``SamplingParams.output_kind`` (vLLM's RequestOutputKind): a ``"final_only"`` request is
reported once, when it finishes, with the tokens a ``"cumulative"`` one gets; ``generate`` uses
it; bad kinds are refused before anything changes."""

from __future__ import annotations

import dataclasses

import pytest
from engine_utils import prompts, small_model

from paged import Engine, EngineConfig, SamplingParams


def _engine() -> Engine:
    # test_engine.py's base configuration: the same compiled step shapes.
    cfg, params = small_model()
    return Engine(EngineConfig(block_size=8, max_num_seqs=8, max_num_batched_tokens=64,
                               max_model_len=64, attention_impl="xla", debug_checks=True,
                               min_token_bucket=64, min_seq_bucket=8),
                  model_config=cfg, params=params)


def test_final_only_reports_once_with_the_same_tokens():
    engine = _engine()
    p = prompts(2, seed=3)
    cases = {  # id -> (prompt, params); pairs differ only in output_kind
        "greedy-c": (p[0], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)),
        "sampled-n2-c": (p[1], SamplingParams(max_tokens=7, temperature=1.0, seed=5, n=2,
                                              ignore_eos=True)),
    }
    for rid, (prompt, sp) in list(cases.items()):
        cases[rid.replace("-c", "-f")] = (prompt, dataclasses.replace(sp, output_kind="final_only"))
    for rid, (prompt, sp) in cases.items():
        engine.add_request(rid, prompt, sp)
    seen: dict[str, list] = {rid: [] for rid in cases}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    for rid in ("greedy", "sampled-n2"):
        cumulative, final = seen[f"{rid}-c"], seen[f"{rid}-f"]
        assert len(cumulative) > 1 and all(not o.finished for o in cumulative[:-1])
        assert len(final) == 1 and final[0].finished  # one report, at the end
        assert ([o.token_ids for o in final[0].outputs]
                == [o.token_ids for o in cumulative[-1].outputs])
        assert final[0].finish_reason == cumulative[-1].finish_reason == "length"
    assert engine.block_manager.num_used_blocks == 0


def test_generate_asks_for_final_outputs_only_and_keeps_tokens():
    engine = _engine()
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    batch = prompts(3, seed=4)
    got = [o.token_ids for o in engine.generate(batch, sp)]
    for i, prompt in enumerate(batch):
        engine.add_request(f"c{i}", prompt, sp)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step())
    assert got == [outs[f"c{i}"].token_ids for i in range(3)]


@pytest.mark.parametrize("kind, err", [("delta", ValueError), ("final", ValueError),
                                       (1, ValueError)])
def test_bad_output_kind_is_refused(kind, err):
    with pytest.raises(err, match="output_kind"):
        SamplingParams(output_kind=kind)


def test_output_kind_bench_smoke(tmp_path):
    import json

    from experiments import output_kind_bench
    from experiments.configs.output_kind_bench import get_config

    c = get_config("smoke")
    c.output_dir = str(tmp_path)
    output_kind_bench.main(c, output_kind_bench.check(c))
    got = json.loads((tmp_path / "output_kind_bench.json").read_text())
    (r,) = got["results"]
    assert r["num_running"] == 4 and len(r["rounds"]) == 2
    assert r["cumulative_median_ms"] > 0 and r["final_only_median_ms"] > 0
    assert "git_revision" in json.dumps(got["provenance"])
