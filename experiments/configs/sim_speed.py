"""Config of `experiments/sim_speed.py`: the simulator's CPU time per simulated request on the
fleet speed study's point, this tree against a baseline tree, alternated round by round.

Launch::

    python -m experiments.sim_speed --config=experiments/configs/sim_speed.py --config.baseline=OLD_TREE
    python -m experiments.sim_speed --config=experiments/configs/sim_speed.py:smoke
    python -m experiments.sim_speed --config=experiments/configs/sim_speed.py --config.breakdown=True

``baseline``: a source tree of an older revision (``git archive <rev> | tar -x -C DIR`` with a
``REVISION`` file, or a worktree); "" measures this tree alone.
"""

import ml_collections


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.baseline = ""  # a source tree of the revision to compare with ("" = none)
    c.num_requests = 10_000  # the speed goal's point: 10^4 requests over 64 replicas
    c.replicas = 64
    c.rounds = 3  # each round runs every tree once, the order alternating
    c.breakdown = False  # then one more run of this tree timing its parts (sim_speed.BREAKDOWN)
    c.output_dir = ""  # default results/sim_speed/<UTC timestamp>/ (writes sim_speed.json)
    if arg == "smoke":
        c.num_requests = 200
        c.replicas = 4
        c.rounds = 1
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
