"""Quality of a quantized KV cache: what int8 / fp8 pages cost against the unquantized model.

Per model (the bundled tiny model, the committed Hugging Face fixtures, a packaged GGUF model
such as ``smollm2-135m``) and per format (``kv_cache_dtype`` x ``kv_scale_granularity``), over
``num_prompts`` constructed prompts (``evidence: constructed``; code-like text, its bytes taken
modulo the vocabulary for the fixtures, encoded by the file's tokenizer for a GGUF model):

* greedy agreement over ``max_tokens`` generated tokens: the fraction of positions where the
  quantized run's token equals the unquantized run's, and the length of the common prefix;
* teacher-forced over the unquantized continuation: the mean KL divergence KL(p_exact || p_quant)
  of next-token distributions and their top-1 agreement;
* prompt log-prob error: mean |log p_quant - log p_exact| of the prompt's own tokens.

Both runs are the no-cache forward (`Llama.dense`), the quantized one with ``kv_quant`` (K and V
read back as a quantized cache stores them). `tests/test_kv_quant_engine.py` checks that the
engine's tokens equal that reference with prefix caching, copy-on-write, swap and speculation on,
so these figures are the engine's. Capacity at equal pool bytes (pages per dtype) is exact from
`paged.accounting` and reported beside them; the serving-rate capacity study per dtype is not run
here.
"""

from __future__ import annotations

import numpy as np

from experiments import common

PROMPTS = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n    for name in argv[1:]:\n        print(",
    "with open(path) as f:\n    for line in f:\n        line = line.strip()\n        if not line",
]


def check(c) -> list[tuple[str, str]]:
    from pallas_kernels import quant

    common.check_positive(max_tokens=c.max_tokens, num_prompts=c.num_prompts,
                          page_size=c.page_size)
    formats = []
    for item in c.formats:
        name, _, granularity = str(item).partition(":")
        quant.storage_dtype(name)
        quant.scale_width(granularity, c.page_size)
        formats.append((name, granularity))
    for model in c.models:
        check_model(model)
    return formats


def check_model(model: str) -> None:
    """A model `common.check_model` accepts, or a packaged GGUF model / ``.gguf`` file."""
    from paged.models.gguf import is_gguf_path, resolve

    if not is_gguf_path(model):
        common.check_model(model)
    elif not resolve(model).is_file():
        raise ValueError(f"model={model!r}: {resolve(model)} not found")


def load(model: str, num: int) -> tuple:
    """``(config, params, prompts)``: a GGUF model's prompts through its tokenizer (with BOS as
    the file says), any other model's as bytes modulo its vocabulary."""
    from paged.models.gguf import is_gguf_path

    if is_gguf_path(model):
        from paged.models.registry import load_any

        config, params, tok = load_any(model)
        return config, params, [tok.encode(t) for t in (PROMPTS * num)[:num]]
    config, params = common.load_model(model)
    return config, params, _prompt_ids(config.vocab_size, num)


def _prompt_ids(vocab: int, num: int) -> list[list[int]]:
    return [[b % vocab for b in text.encode()] for text in (PROMPTS * num)[:num]]


def _forward(config, kv_quant):
    import jax

    from paged.models.llama import Llama

    model = Llama(config)
    return jax.jit(lambda p, t: model.apply(p, t, method="dense", kv_quant=kv_quant))


def _greedy(fn, params, prompt, max_tokens):
    import jax.numpy as jnp

    tokens, width = list(prompt), len(prompt) + max_tokens
    for _ in range(max_tokens):
        padded = np.zeros((1, width), np.int32)
        padded[0, :len(tokens)] = tokens
        tokens.append(int(jnp.argmax(fn(params, jnp.asarray(padded))[0, len(tokens) - 1])))
    return tokens[len(prompt):]


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(exact_fn, quant_fn, params, prompt, want) -> dict:
    """One prompt's quality figures (see the module docstring); ``want`` is the unquantized
    model's greedy continuation."""
    import jax.numpy as jnp

    max_tokens = len(want)
    got = _greedy(quant_fn, params, prompt, max_tokens)
    same = [a == b for a, b in zip(want, got, strict=True)]
    prefix = same.index(False) if False in same else len(same)
    seq = jnp.asarray([prompt + want], jnp.int32)
    lp_exact, lp_quant = (_log_softmax(f(params, seq)[0]) for f in (exact_fn, quant_fn))
    n = len(prompt)
    rows = slice(n - 1, n - 1 + max_tokens)  # predicting the continuation
    p = np.exp(lp_exact[rows])
    kl = float(np.mean(np.sum(p * (lp_exact[rows] - lp_quant[rows]), axis=-1)))
    top1 = float(np.mean(lp_exact[rows].argmax(-1) == lp_quant[rows].argmax(-1)))
    ids = np.asarray(prompt[1:])
    pos = np.arange(n - 1)
    lp_err = float(np.mean(np.abs(lp_quant[pos, ids] - lp_exact[pos, ids])))
    return {"greedy_agreement": float(np.mean(same)), "greedy_common_prefix": prefix,
            "kl_mean": kl, "top1_agreement": top1, "prompt_logprob_abs_err": lp_err}


def capacity(config, page_size: int, formats, budget: int = 1 << 30) -> dict:
    """Pages of ``page_size`` a pool of ``budget`` bytes holds, per format (exact formula)."""
    from paged import accounting

    out = {}
    for name, granularity in [("auto", "token"), *formats]:
        spec = accounting.ModelSpec.from_model_config(config, dtype="bfloat16",
                                                      kv_cache_dtype=name,
                                                      scale_granularity=granularity)
        key = "bfloat16" if name == "auto" else f"{name}:{granularity}"
        out[key] = spec.blocks_for_bytes(budget, page_size)
    return {"budget_bytes": budget, "page_size": page_size, "pages": out}


def main(c, formats) -> None:
    out_dir = common.output_dir(c, "kv_quant")
    results = []
    total = len(c.models) * len(formats) * c.num_prompts
    with common.Progress(total, "kv_quant", unit="runs") as bar:
        for model in c.models:
            config, params, prompts = load(model, c.num_prompts)
            exact_fn = _forward(config, None)
            wants = [_greedy(exact_fn, params, p, c.max_tokens) for p in prompts]
            for name, granularity in formats:
                quant_fn = _forward(config, (name, granularity, c.page_size))
                per_prompt = []
                for prompt, want in zip(prompts, wants, strict=True):
                    per_prompt.append(compare(exact_fn, quant_fn, params, prompt, want))
                    bar.update()
                row = {"model": model, "kv_cache_dtype": name, "kv_scale_granularity": granularity}
                for key in per_prompt[0]:
                    row[key] = float(np.mean([r[key] for r in per_prompt]))
                row["per_prompt"] = per_prompt
                results.append(row)
                print(f"{model:<32} {name:>9}:{granularity:<5} greedy {row['greedy_agreement']:.3f} "
                      f"KL {row['kl_mean']:.2e} top1 {row['top1_agreement']:.3f} "
                      f"prompt-lp err {row['prompt_logprob_abs_err']:.2e}", flush=True)
            results_capacity = capacity(config, c.page_size, formats)
            results.append({"model": model, "capacity_at_equal_bytes": results_capacity})
    payload = {"study": "kv_quant", "evidence": "constructed", "config": c.to_dict(),
               "provenance": common.provenance(), "load": _load(), "results": results}
    path = common.write_result(out_dir / "kv_quant.json", payload)
    print(f"wrote {path}")


def _load() -> dict:
    import os

    return {"loadavg": os.getloadavg(), "cpu_count": os.cpu_count()}


if __name__ == "__main__":
    common.run("kv_quant", main, check)
