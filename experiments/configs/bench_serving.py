"""Config of `experiments/bench_serving.py` (an HTTP benchmark client for OpenAI-compatible servers).

Launch (a server must be running, e.g. ``python -m paged.server --model tiny --port 8000``)::

    python -m experiments.bench_serving --config.base_url=http://127.0.0.1:8000 --config.model=tiny
    python -m experiments.bench_serving --config=experiments/configs/bench_serving.py:smoke
    python -m experiments.bench_serving --config.workload.rate=20 --config.workload.num_requests=200

The workload is made here exactly as the serving studies make it (``config.workload``, same keys
as `experiments/configs/serve.py`; ``max_model_len`` scales its lengths and must not exceed the
server's). Prompts are sent as token ids (lengths exact), ``max_tokens`` = the request's output
length, ``ignore_eos`` true, greedy. Variants: ``default``, ``smoke`` (a handful of short
requests; what the test runs).
"""

import ml_collections

from experiments.configs.serve import workload_defaults


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.base_url = "http://127.0.0.1:8000"
    c.model = "tiny"  # the model id the server serves (``/v1/models``)
    c.endpoint = "/v1/completions"
    c.max_model_len = 256  # the workload's context window (lengths are scaled to it)
    c.workload = workload_defaults()
    c.max_concurrency = 0  # requests in flight at most (0: no limit; arrivals alone decide)
    c.request_timeout_s = 600.0  # per HTTP request (connect + whole stream)
    c.ttft_slo_ms = 2000.0
    c.tpot_slo_ms = 200.0
    c.save_generated_texts = False  # also write vLLM's generated_texts (index-0 choice texts)
    c.output_dir = ""  # default results/bench_serving/<UTC timestamp>/
    if arg == "smoke":
        c.max_model_len = 64
        c.workload.num_requests = 6
        c.workload.rate = 20.0
        c.request_timeout_s = 60.0
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
