"""experiments/train_tiny.py: the smoke config trains, saves, and loads back; configs are valid."""

import json

import numpy as np
import pytest

from experiments.configs import train_tiny as train_config
from paged.models import LlamaConfig
from paged.models.registry import load_from


# ml_collections loads the default config file with the deprecated importlib load_module().
@pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")
def test_smoke_config_trains_and_round_trips(tmp_path):
    from experiments.train_tiny import train

    config = train_config.get_config("smoke")
    config.output_dir = str(tmp_path)
    record = train(config, command="pytest")
    saved = json.loads((tmp_path / "smoke.json").read_text())
    for key in ("config", "steps", "final_train_loss", "final_eval_loss", "wall_time_s",
                "command", "jax_version", "corpus", "npz_sha256"):  # fmt: skip
        assert key in saved, key
    assert saved["steps"] == 3 and np.isfinite(record["final_eval_loss"])
    cfg, params = load_from(tmp_path / "smoke.npz", tmp_path / "smoke.json")
    assert cfg == LlamaConfig(**config.model.to_dict())
    assert params["params"]["embedding"].dtype == np.float32


@pytest.mark.parametrize("arg", ["tiny", "tiny-draft", "smoke"])
def test_configs_build_valid_models(arg):
    config = train_config.get_config(arg)
    model = LlamaConfig(**config.model.to_dict())
    assert model.vocab_size == 258  # every variant shares the ByteTokenizer
    assert 0 <= config.warmup_steps < config.steps


def test_unknown_variant_raises():
    with pytest.raises(ValueError, match="nope"):
        train_config.get_config("nope")
