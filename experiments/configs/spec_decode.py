"""Config of `experiments/spec_decode.py`: speculative decoding (n-gram and draft-model proposals)
against plain decoding.

Launch::

    python -m experiments.spec_decode
    python -m experiments.spec_decode --config=experiments/configs/spec_decode.py:smoke
    python -m experiments.spec_decode --config.ks=1,2,4 --config.batch_sizes=1,8

Variants: ``default`` (the bundled tiny model with tiny-draft, k = 1..8, batch 1 and 8, then the
offered-load sweep at 4..64 requests/s with 8 sequences), ``smoke`` (a small random model, n-gram
only, few tokens, one tiny load point: what the test runs).
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
    c.repeats = 5  # timed runs per arm (interleaved plain / speculative), medians reported
    c.engine = engine_config_dict(max_model_len=256, max_num_batched_tokens=256,
                                  attention_impl="xla", max_num_seqs=None, speculative=None)
    # Offered load: Poisson arrivals served in real time, speculation off and on.
    c.load_rates = (4.0, 8.0, 16.0, 32.0, 64.0)  # requests/s; () skips the sweep
    c.load_prompts = "code"  # "code" or "prose"
    c.load_method = ""  # "" = the method of the best batch-1 speed-up on load_prompts
    c.load_k = 0  # 0 = the k of the best batch-1 speed-up (of load_method if set)
    c.load_num_requests = 48  # per run
    c.load_max_num_seqs = 8
    c.load_min_seq_bucket = 8  # one sequence bucket: few step shapes, all compiled by the warm-up
    c.load_plain_async = False  # the plain arm serial like the speculative one (isolates speculation)
    c.load_repeats = 3  # runs per rate and arm (interleaved, order alternating), medians reported
    c.load_seed = 0
    # Before timing: Engine.warmup (every plain step shape), then one run of each rate (the
    # verify steps' shapes, which Engine.warmup does not compile); timed runs count compilations.
    c.load_warmup = True
    c.load_max_wall_s = 120.0  # per run: later requests are aborted / rejected (and reported)
    c.output_dir = ""  # default results/spec_decode/<UTC timestamp>/
    if arg == "smoke":
        c.model = "random-small"
        c.methods = ("ngram",)  # a draft needs the model's vocabulary: the bundled pair has it
        c.ks = (1, 3)
        c.batch_sizes = (1,)
        c.max_tokens = 8
        c.repeats = 1
        c.engine.max_model_len = 128
        c.load_rates = (500.0,)
        c.load_num_requests = 2
        c.load_max_num_seqs = 1  # the batch-1 engines, compiled already
        c.load_min_seq_bucket = 1
        c.load_repeats = 1
        c.load_warmup = False
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
