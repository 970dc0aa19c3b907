"""Config of `experiments/host_speed.py`: the block manager's decode step against nano-vllm's, on
this tree and (optionally) on a baseline source tree, alternated round by round.

Launch::

    python -m experiments.host_speed --config=experiments/configs/host_speed.py \
        --config.nanovllm_path=DIR --config.baseline=OLD_TREE
    python -m experiments.host_speed --config=experiments/configs/host_speed.py:smoke

``nanovllm_path``: a local snapshot of nano-vllm's sources (``experiments/block_manager_bench.py``
says which files); "" runs without it (our step times only, no ratios). ``baseline``: a checkout
of an older revision of this repository (e.g. ``git worktree add /tmp/old <rev>``); "" measures
this tree alone.
"""

import ml_collections


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.nanovllm_path = ""
    c.baseline = ""  # a source tree of the revision to compare with ("" = none)
    c.num_requests = 3000  # requests of block_manager_bench's trace (its other settings kept)
    c.apis = ("batch", "engine")  # block_manager_bench's decode-call styles to compare
    c.rounds = 3  # each round runs every tree once, the order alternating
    # the cyclic collector during each replay, alike for both sides (host_speed.GC_NOTE): "off",
    # "frozen" (the runs before 2026-12-06), "on"; comma-separated = one arm per mode
    c.gc = "off"
    c.output_dir = ""  # default results/host_speed/<UTC timestamp>/ (writes host_speed.json)
    if arg == "smoke":
        c.num_requests = 300
        c.apis = ("batch",)
        c.rounds = 1
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
