"""Config of `experiments/spec_decode.py`: speculative decoding (n-gram and draft-model proposals)
against plain decoding.

Launch::

    python -m experiments.spec_decode
    python -m experiments.spec_decode --config=experiments/configs/spec_decode.py:smoke
    python -m experiments.spec_decode --config.ks=1,2,4 --config.batch_sizes=1,8

Variants: ``default`` (the bundled tiny model with tiny-draft, k = 1..8, batch 1 and 8), ``smoke``
(a small random model, n-gram only, few tokens: what the test runs).
"""

import ml_collections

from experiments.configs.engine_fields import engine_config_dict


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "tiny"
    c.methods = ("ngram", "draft")
    c.draft_model = "tiny-draft"  # for method "draft": the same vocabulary as the model
    c.ks = (1, 2, 4, 6, 8)  # num_speculative_tokens
    c.ngram_min = 1
    c.ngram_max = 4
    c.batch_sizes = (1, 8)  # beyond batch 1: where speculation stops paying
    c.max_tokens = 96
    c.repeats = 3  # timed runs per arm (interleaved plain / speculative), medians reported
    c.engine = engine_config_dict(max_model_len=256, max_num_batched_tokens=256,
                                  attention_impl="xla", max_num_seqs=None, speculative=None)
    c.output_dir = ""  # default results/spec_decode/<UTC timestamp>/
    if arg == "smoke":
        c.model = "random-small"
        c.methods = ("ngram",)  # a draft needs the model's vocabulary: the bundled pair has it
        c.ks = (1, 3)
        c.batch_sizes = (1,)
        c.max_tokens = 8
        c.repeats = 1
        c.engine.max_model_len = 128
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
