"""Quality of an arm the engine does not serve yet, from the no-cache forward (`Llama.dense`).

int4 / int2 KIVI pages (`pallas_kernels.kivi`) exist as ops and as the no-cache reference of
their quantize-on-fill semantics (``kv_quant=("int4", "kivi", page)``: each query reads the pages
full at its position quantized and its open page exact), not in the engine. For such an arm
`experiments.quality` takes:

* **perplexity** from the teacher-forced dense forward (the log-probability of token ``i`` given
  its prefix: what the engine's prompt log-probabilities compute, up to float rounding);
* **retrieval** by greedy decoding with the dense forward re-run on the growing sequence (no
  cache; the sequence padded to a multiple of 256 so a few shapes compile), stopped at a stop
  token or ``max_tokens``; scored like the engine arms (the answer in the decoded text).
"""

from __future__ import annotations

import numpy as np

MAX_TOKENS = 24  # as experiments.quality.retrieval
PAD = 256


def _forward(config, kv_quant):
    import jax

    from paged.models.llama import Llama

    return jax.jit(lambda p, t: Llama(config).apply(p, t, method="dense", kv_quant=kv_quant))


def perplexity(config, params, chunk_sets: dict[int, list[list[int]]], kv_quant) -> dict:
    """Per chunk length: token-weighted perplexity of the dense forward with ``kv_quant``."""
    import jax
    import jax.numpy as jnp

    fn = _forward(config, kv_quant)
    out = {}
    for length, chunk_list in chunk_sets.items():
        nll = []
        for ids in chunk_list:
            logits = fn(params, jnp.asarray([ids], jnp.int32))[0]
            lp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
            nll.extend(-lp[i - 1, ids[i]] for i in range(1, len(ids)))
        out[str(length)] = {"perplexity": float(np.exp(np.mean(nll))),
                            "nll_mean": float(np.mean(nll)), "tokens": len(nll)}
    return out


def greedy(fn, params, prompt: list[int], stops, max_tokens: int = MAX_TOKENS) -> list[int]:
    """Greedy continuation of ``prompt`` by the dense forward ``fn`` (no cache)."""
    import jax.numpy as jnp

    ids, out = list(prompt), []
    for _ in range(max_tokens):
        n = len(ids)
        padded = np.zeros((1, -(-n // PAD) * PAD), np.int32)
        padded[0, :n] = ids
        nxt = int(jnp.argmax(fn(params, jnp.asarray(padded))[0, n - 1]))
        if nxt in stops:
            break
        ids.append(nxt)
        out.append(nxt)
    return out


def retrieval(config, params, tok, needle_list, kv_quant) -> dict:
    """Exact-match accuracy per (length, depth) of greedy dense decoding with ``kv_quant``."""
    fn = _forward(config, kv_quant)
    stops = set(getattr(tok, "eos_ids", ()) or (tok.eos_id,))
    cells: dict[str, list[bool]] = {}
    for n in needle_list:
        text = tok.decode(greedy(fn, params, n.prompt_ids, stops))
        cells.setdefault(f"{n.length}@{n.depth}", []).append(n.answer in text)
    acc = {k: float(np.mean(v)) for k, v in cells.items()}
    acc["all"] = float(np.mean([v for vs in cells.values() for v in vs]))
    return acc
