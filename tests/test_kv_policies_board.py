"""The KV-policy leaderboard's columns (`experiments/kv_policies*.py`): the jitted masked pass
equals the eager reference the engine is tested against; the Pareto fronts; which arms share a
fleet simulation; a policy given as a mapping in a study's config."""

from __future__ import annotations

import numpy as np
import pytest
from engine_utils import small_model
from kv_policy_reference import reference

from experiments import kv_policies_board as board
from experiments import kv_policies_fidelity as fid
from experiments import kv_policies_fleet as fleet
from experiments.configs.engine_fields import make_engine_config
from paged.config.kv_policy import KVPolicyConfig
from paged.kv import policies


@pytest.mark.parametrize("pol", [KVPolicyConfig("knorm", budget=0.5, interval=6),
                                 KVPolicyConfig("h2o", budget=0.5, recent_tokens=2, interval=6)],
                         ids=lambda p: p.method)
def test_jitted_pass_equals_the_eager_reference(pol):
    """The same calls (kept positions) and log-probabilities; H2O's mass goes through the
    jitted pass's probabilities."""
    cfg, params = small_model()
    rng = np.random.default_rng(0)
    tokens = [256] + rng.integers(0, 256, 29).tolist()
    pol = policies.build(pol)
    want, calls = reference(cfg, params, tokens, pol, 20)
    got, calls_j = reference(cfg, params, tokens, pol, 20, run=fid.jit_pass(cfg, params))
    assert len(calls) == len(calls_j) == 2
    for (c, k), (cj, kj) in zip(calls, calls_j):
        assert c == cj and (k == kj).all()
    np.testing.assert_allclose(got, want, atol=1e-4)
    cont = fid.continuation_logprobs(cfg, params, fid.jit_pass(cfg, params), tokens,
                                     KVPolicyConfig("knorm", budget=0.5, interval=6), 20)
    assert cont.shape == (10, want.shape[1])
    scored = fid.score([cont], [cont], [tokens], 20)
    assert scored["kl_mean"] == 0.0 and scored["top1_agreement"] == 1.0


def _row(arm, retrieval, kl, nbytes):
    return {"arm": arm, "retrieval": retrieval, "kl_mean": kl, board.BYTES: nbytes}


def test_pareto_fronts():
    rows = [_row("full", 1.0, 0.0, 100), _row("a", 0.5, 0.2, 50), _row("b", 0.4, 0.1, 50),
            _row("c", 0.5, 0.3, 60), _row("d", 0.0, 0.5, 10)]
    assert board.pareto(rows, "retrieval", True) == {"full", "a", "d"}
    assert board.pareto(rows, "kl_mean", False) == {"full", "b", "d"}


def test_fleet_key_groups_arms_that_free_the_same_blocks():
    k = fleet.key
    assert k(None) == k(KVPolicyConfig("full")) == ("full",)
    assert k(KVPolicyConfig("knorm", budget=0.25)) == k(KVPolicyConfig("streaming_llm",
                                                                        budget=0.25))
    assert k(KVPolicyConfig("knorm", budget=0.25)) != k(KVPolicyConfig("knorm", budget=0.5))


def test_a_kv_policy_mapping_in_a_study_config():
    cfg = make_engine_config({}, kv_policy=dict(method="knorm", budget=0.25),
                             check_backend=False)
    assert cfg.kv_policy == KVPolicyConfig("knorm", budget=0.25)
