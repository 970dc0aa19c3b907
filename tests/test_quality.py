"""The quality harness on SmolLM2 (`experiments/quality.py`): arms, inputs, config checks; the
smoke runs of it and of `experiments/real_model_decode.py` are slow (a minute or more on 2 CPU
cores) and run with ``-m slow``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import quality, quality_tasks
from experiments.configs.quality import get_config
from paged.models.gguf import packaged_path

ROOT = Path(__file__).resolve().parents[1]
try:
    packaged_path("smollm2-135m")
except ValueError as e:  # pragma: no cover -- `make install` installs it
    pytest.skip(str(e), allow_module_level=True)


def test_arms_parse():
    assert quality.parse_arm("float32") == quality.Arm("float32")
    assert quality.parse_arm("bfloat16").dtype == "bfloat16"
    arm = quality.parse_arm("fp8_e4m3:page")
    assert (arm.kv_cache_dtype, arm.granularity) == ("fp8_e4m3", "page")
    assert quality.parse_arm("window:256").window == 256
    for bad in ("int4:token", "int8:row", "window:x", "window:4", "float64"):
        with pytest.raises(ValueError):
            quality.parse_arm(bad)


def test_config_checks():
    assert [a.name for a in quality.check(get_config())][0] == "float32"
    c = get_config("smoke")
    with c.unlocked():
        c.arms = ("int8:token",)
    with pytest.raises(ValueError, match="first arm must be 'float32'"):
        quality.check(c)
    c = get_config("smoke")
    with c.unlocked():
        c.exact_checks = ("speculation",)
    with pytest.raises(ValueError, match="not supported"):
        quality.check(c)


def test_variants_and_kv_quant_on_smollm2():
    for variant in ("smoke", "exact", "long", "long_smoke"):
        quality.check(get_config(variant))
    assert get_config("exact").arms == () and get_config("long_smoke").chunk_lengths == (8192,)
    c = get_config("exact")
    with c.unlocked():
        c.exact_checks = ()
    with pytest.raises(ValueError, match="nothing to run"):
        quality.check(c)
    from experiments import kv_quant
    from experiments.configs.kv_quant import get_config as kv_config

    assert len(kv_quant.check(kv_config("smollm2"))) == 6
    with pytest.raises(ValueError, match="not found"):
        kv_quant.check_model("/nonexistent/model.gguf")


def test_corpus_and_needles():
    from paged.models.gguf_tokenizer import GGUFTokenizer

    text = quality_tasks.corpus_text()
    assert len(text) > 400_000 and "assert" in text
    tok = GGUFTokenizer("smollm2-135m")
    ids = tok.encode(text[:50_000], add_bos=False)
    parts = quality_tasks.chunks(ids, 512, 3)
    assert [len(p) for p in parts] == [512] * 3 and parts[1][0] == ids[512]
    with pytest.raises(ValueError, match="corpus has"):
        quality_tasks.chunks(ids, 512, 10_000)
    needles = quality_tasks.needles(tok, ids, 1024, 0.5, 2, seed=0)
    assert len({n.answer for n in needles}) == 2
    for n in needles:
        assert abs(len(n.prompt_ids) - 1024) < 64
        text = tok.decode(n.prompt_ids, skip_special_tokens=False)
        assert f"is {n.answer}." in text and text.endswith("<|im_start|>assistant\n")
    assert needles == quality_tasks.needles(tok, ids, 1024, 0.5, 2, seed=0)  # reproducible


def _study(tmp_path, module, config, *flags):
    proc = subprocess.run([sys.executable, "-m", f"experiments.{module}", f"--config={config}",
                           f"--config.output_dir={tmp_path}", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_quality_smoke(tmp_path):
    _study(tmp_path, "quality", "experiments/configs/quality.py:smoke")
    payload = json.loads((tmp_path / "quality.json").read_text())
    assert payload["evidence"] == {"perplexity": "real", "fidelity": "real",
                                   "retrieval": "constructed", "exact_checks": "real"}
    rows = {r["arm"]: r for r in payload["rows"]}
    ref = rows["float32"]
    assert ref["fidelity"]["kl_mean"] == 0.0 and ref["fidelity"]["top1_agreement"] == 1.0
    assert 5 < ref["perplexity"]["256"]["perplexity"] < 60
    assert rows["fp8_e5m2:page"]["fidelity"]["kl_mean"] > rows["int8:token"]["fidelity"]["kl_mean"]
    assert {r["status"] for r in payload["exact_checks"].values()} == {"passed"}
    assert set(payload["exact_checks"]) == {"prefix_caching", "preemption_swap"}
    assert (tmp_path / "quality.png").stat().st_size > 0


@pytest.mark.slow
def test_real_model_decode_smoke(tmp_path):
    _study(tmp_path, "real_model_decode", "experiments/configs/real_model_decode.py:smoke")
    payload = json.loads((tmp_path / "real_model_decode.json").read_text())
    assert [r["batch_size"] for r in payload["rows"]] == [1, 2]
    assert all(r["paged"]["tokens_per_s_median"] > 0 for r in payload["rows"])


def test_exact_checks_machinery_on_a_small_model():
    """`experiments.quality_exact` on a small random model (the real model's run is the study's):
    the mechanisms ran (evidence > 0) and changed nothing, bitwise; a pair the support matrix
    refuses (cascade on a sliding-window model) is recorded with its reason; a changed output
    fails the check."""
    import dataclasses

    import numpy as np
    from engine_utils import small_model

    from experiments import quality_exact as exact
    from paged import Engine, EngineConfig

    cfg, params = small_model()
    corpus = np.random.default_rng(0).integers(0, 256, 400).tolist()

    def make(model_config):
        return lambda **kw: Engine(EngineConfig(**{**exact.SHAPE, "attention_impl": "xla", **kw}),
                                   model_config=model_config, params=params)

    out = exact.run_checks(["preemption_swap", "prefix_caching"], make(cfg), corpus,
                           max_tokens=6)
    for name, r in out.items():
        assert r["status"] == "passed" and r["identical_tokens"], (name, r)
        assert r["max_abs_logprob_diff"] == 0.0 and all(v > 0 for v in r["evidence"].values())
    sliding = dataclasses.replace(cfg, sliding_window=32)
    out = exact.run_checks(["cascade"], make(sliding), corpus, max_tokens=2)
    assert out["cascade"]["status"] == "refused"
    assert "[refused pair: cascade + sliding_window]" in out["cascade"]["reason"]
    assert exact.compare([([1, 2], [-0.5, -1.0])], [([1, 2], [-0.5, -1.25])]) == (True, 0.25)
    assert not exact.compare([([1, 3], [])], [([1, 2], [])])[0]
    assert set(get_config().exact_checks) == set(exact.CHECKS)
