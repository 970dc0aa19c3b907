"""``Engine.warmup``: bounded by default, one line saying what it compiles, and nothing compiled
after it, by the engine's count (``num_compilations``: steps and page copies) and by JAX's own
trace events, for requests that fork (``n`` = 2, 3, 8: copy-on-write copies at 1-8 pages)."""

from __future__ import annotations

import jax.monitoring
import pytest

from paged.config.engine_config import EngineConfig
from paged.engine.engine import Engine
from paged.request.sampling import SamplingParams
from tests.engine_utils import small_model

_TRACE = "/jax/core/compile/jaxpr_trace_duration"


def test_warmup_refuses_an_unbounded_plan_before_compiling(capsys):
    cfg, params = small_model()
    engine = Engine(EngineConfig(max_model_len=256, attention_impl="xla"),
                    model_config=cfg, params=params)
    with pytest.raises(ValueError, match=r"244 step shapes .*min_token_bucket=128, "
                                         r"min_seq_bucket=32"):
        engine.warmup()
    assert engine.num_compilations == 0


def test_no_compilation_after_warmup_for_forks(capsys):
    cfg, params = small_model()
    engine = Engine(EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                                 max_model_len=32, attention_impl="xla", min_token_bucket=16,
                                 min_seq_bucket=8), model_config=cfg, params=params)
    compiled = engine.warmup()
    line = capsys.readouterr().err
    assert "warmup: compiling 4 step shapes" in line and "4 copy-on-write sizes" in line, line
    assert compiled == engine.num_compilations >= 4  # steps + copies (fewer if compiled before)
    traces = []

    def listen(event, duration, **kwargs):
        if event == _TRACE:
            traces.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        prompt = [256, 1, 2, 3, 4, 5]  # a partial last page: every fork copies it
        for n in (2, 3, 8):
            outs = engine.generate([prompt], SamplingParams(max_tokens=6, n=n, seed=n,
                                                            ignore_eos=True))
            assert len(outs[0].outputs) == n
        engine.generate([prompt] * 2, [SamplingParams(max_tokens=3, n=4, logprobs=2),
                                       SamplingParams(max_tokens=3, n=2, logprobs=0)])
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert engine.block_manager.stats()["cow_copies"] > 0
    assert traces == [] and engine.num_compilations == compiled, traces
    assert traces == []
