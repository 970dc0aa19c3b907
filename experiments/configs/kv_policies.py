"""Config of `experiments/kv_policies.py`: KV eviction policies (method x budget) on a real
pretrained model (SmolLM2-135M-Instruct, GGUF): retrieval, agreement with full KV, and the KV
bytes a sequence really holds (the ledger).

Launch::

    python -m experiments.kv_policies
    python -m experiments.kv_policies --config=experiments/configs/kv_policies.py:smoke

Arms: "full" (the reference) or "<method>:<budget>" with a method of
``paged.config.kv_policy.METHODS`` and a budget as ``KVPolicyConfig.budget`` (a fraction
``0.25`` or a token count ``256``). The policy runs once, when the prompt's prefill ends
(kvpress's setting: compress the context, then answer). Variants: ``default`` (1k and 2k
retrieval at three depths, every method of ``METHODS`` at budgets 10 / 25 / 50 % and 256
tokens), ``smoke`` (1k, one
depth, two needles, 25 / 50 %; a short fidelity chunk; a short fleet search). ``--config.arms``
runs a piece of the grid (the first arm must be "full"); `experiments/kv_policies_board.py`
joins pieces into one table and one plot.
"""

import ml_collections

from paged.config.kv_policy import METHODS


def get_config(arg: str = "default") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "smollm2-135m"
    c.arms = ("full", *(f"{m}:{b}" for m in METHODS if m != "full"
                        for b in ("0.1", "0.25", "0.5", "256")))
    c.needle_lengths = (1024, 2048)
    c.needle_depths = (0.1, 0.5, 0.9)
    c.needles_per_cell = 2
    c.sink_tokens = 4
    c.block_size = 16
    c.max_num_batched_tokens = 512
    c.max_tokens = 24
    c.seed = 0
    c.output_dir = ""  # default results/kv_policies/<UTC timestamp>/
    # Join pieces instead of running (`experiments/kv_policies_board.py`): their folders, and
    # optionally the engine capacity of `experiments/capacity.py`'s kv_policy variant.
    c.join = ()
    c.join_capacity = ()
    # Perplexity and KL against full KV (`experiments/kv_policies_fidelity.py`): corpus chunks of
    # a prefix (the prompt; the policy runs when it ends) and a teacher-forced continuation.
    c.fidelity_prefix = 1024
    c.fidelity_continuation = 64
    c.fidelity_chunks = 2
    # The simulator's fleet capacity (`experiments/kv_policies_fleet.py`): one modelled H200
    # replica of ``model`` (`paged.sim.specs.MODELS`), ``kv_gb`` of KV (0.9 x 141 GB - 16 GB of
    # bf16 weights), fixed long prompts; capacity by bracket then bisection at the SLO.
    c.fleet = ml_collections.ConfigDict(dict(
        enabled=True, model="Llama-3-8B", kv_gb=110.0, block_size=16, prompt_len=3072,
        output_len=1024, max_num_seqs=512, max_num_batched_tokens=4096, seed=0, duration_s=60.0,
        max_requests=1000, max_time_factor=3.0, ttft_slo_ms=2000.0, tpot_slo_ms=100.0,
        load_threshold=16, rate_lo=2.0, rate_hi=8.0, bisect_steps=4))
    if arg == "smoke":
        c.arms = ("full", "streaming_llm:0.25", "streaming_llm:0.5", "knorm:0.25", "knorm:0.5")
        c.needle_lengths = (1024,)
        c.needle_depths = (0.5,)
        c.needles_per_cell = 2
        c.fidelity_prefix, c.fidelity_continuation, c.fidelity_chunks = 512, 32, 1
        c.fleet.update(dict(prompt_len=1024, output_len=256, duration_s=10.0, max_requests=60,
                            bisect_steps=1))
    elif arg != "default":
        raise ValueError(f"unknown variant {arg!r}; known: default, smoke")
    return c
