"""Config of `experiments/trace_stats.py`: the Azure LLM inference traces 2023, characterised.

Launch::

    python -m experiments.trace_stats                      # both traces, whole hour
    python -m experiments.trace_stats --config=experiments/configs/trace_stats.py:smoke
    python -m experiments.trace_stats --config.services="('conv',)" --config.window="(600, 1200)"

Per trace: requests, arrival span, mean rate, requests per minute (plot), inter-arrival
coefficient of variation, mean and p50 / p90 / p99 / max of context and generated tokens
(histograms, log axes), beside the figures the Splitwise paper gives for the same traces.
Variants: ``default`` (every request), ``smoke`` (the first 300 s of each; what the test runs).
"""

import ml_collections

# The Splitwise paper's (Patel et al., ISCA 2024) characterisation of these traces, as the issue
# quotes it: medians of prompt (context) and generated tokens. ``tolerance`` is the paper's
# rounding as we read it: "about 1,500" to the nearest 100, 1,020 to the nearest 10, token counts
# 13 and 129 as integers (a median of integers can end in .5).
PAPER = {
    "code": {"p50_context_tokens": 1500, "p50_context_tokens_tolerance": 50,
             "p50_generated_tokens": 13, "p50_generated_tokens_tolerance": 0.5},
    "conv": {"p50_context_tokens": 1020, "p50_context_tokens_tolerance": 5,
             "p50_generated_tokens": 129, "p50_generated_tokens_tolerance": 0.5},
}


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.services = ("code", "conv")
    c.window = ()  # () = the whole trace; (start_s, end_s) = that window of each (a derivation)
    c.rate_bin_s = 60.0  # width of the rate-per-minute bins
    c.plots = True
    c.output_dir = ""  # default results/trace_stats/<UTC timestamp>/
    if arg == "smoke":
        c.window = (0.0, 300.0)
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
