"""What each KV mechanism costs in model quality, on a real pretrained model (SmolLM2-135M).

The KV mechanism is the factor (``config.arms``, see `experiments/configs/quality.py`); per arm:

* **perplexity** over chunks of a real English corpus (`experiments.quality_tasks`), from the
  engine's prompt log-probabilities (``SamplingParams.prompt_logprobs=0``): the arm's engine
  writes and reads its own KV (quantized pages, windows), prefill chunked as it serves;
  ``evidence: real``;
* **fidelity**: teacher-forced next-token KL(p_float32 || p_arm) and top-1 agreement over the
  corpus, from the no-cache forward (`Llama.dense`) with the arm's KV reproduced (``kv_quant``
  quantizes K/V as the pages store them; windows mask as the engine does; the engine equals this
  reference, `tests/test_kv_quant_engine.py`); ``evidence: real``;
* **retrieval**: needle-in-a-haystack key-value retrieval at several lengths and depths through
  the chat template, greedy, scored by exact match of the value; ``evidence: constructed``.

Mechanisms that must be exact (``config.exact_checks``: prefix caching, cascade, host tier,
preemption by recompute and by swap, n-gram and draft speculation) are checks, not figures
(`experiments.quality_exact`): a short workload on the float32 engine with the mechanism on
against the plain engine; tokens and log-probabilities must be identical, else the study fails;
a mechanism the support matrix refuses for the model is recorded as refused, with the reason.
With ``arms=()`` only the checks run.

Arms "int4:kivi" / "int2:kivi" (KIVI pages) take perplexity and retrieval from the no-cache
forward with their quantize-on-fill semantics (`experiments.quality_dense`; the row says
``"source": "dense (no cache)"``); "int4:engine" / "int2:engine" serve the same pages through
the engine (``kv_cache_dtype="int4"``: packed pool, open page in the model dtype).

Writes ``quality.json`` (config, provenance, corpus, per-arm rows) and ``quality.png``.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from experiments import common
from experiments import quality_exact as exact
from experiments import quality_tasks as tasks

QUANT_GRANULARITIES = ("token", "page")


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    granularity: str = "token"
    window: int | None = None


def parse_arm(text: str) -> Arm:
    """An arm of ``config.arms`` (see the config's docstring); ValueError naming it."""
    from pallas_kernels import quant

    text = str(text)
    if text in ("float32", "bfloat16"):
        return Arm(text, dtype=text)
    kind, _, arg = text.partition(":")
    if kind == "window":
        if not arg.isdigit() or int(arg) < 16:
            raise ValueError(f"arm {text!r}: window:<W> needs an integer W >= 16")
        return Arm(text, window=int(arg))
    if kind in ("int4", "int2") and arg in ("kivi", "engine"):  # dense forward, or the engine
        return Arm(text, kv_cache_dtype=kind, granularity=arg)
    quant.storage_dtype(kind)
    if arg not in QUANT_GRANULARITIES:
        raise ValueError(f"arm {text!r}: the scale granularity must be one of "
                         f"{QUANT_GRANULARITIES}")
    return Arm(text, kv_cache_dtype=kind, granularity=arg)


def check(c) -> list[Arm]:
    from paged.models.gguf import is_gguf_path, resolve

    common.check_positive(num_chunks=c.num_chunks, fidelity_length=c.fidelity_length,
                          fidelity_chunks=c.fidelity_chunks, needles_per_cell=c.needles_per_cell,
                          block_size=c.block_size, max_num_batched_tokens=c.max_num_batched_tokens)
    for n in (*c.chunk_lengths, *c.needle_lengths):
        common.check_positive(length=n)
    if not all(0.0 <= d <= 1.0 for d in c.needle_depths):
        raise ValueError(f"needle_depths={c.needle_depths} must lie in [0, 1]")
    if not is_gguf_path(c.model):
        raise ValueError(f"model={c.model!r} must be a packaged GGUF model or a .gguf file")
    if not resolve(c.model).is_file():
        raise ValueError(f"model={c.model!r}: {resolve(c.model)} not found")
    unknown = sorted(set(c.exact_checks) - set(exact.CHECKS))
    if unknown:
        raise ValueError(f"exact_checks {unknown} are not supported; supported: "
                         f"{sorted(exact.CHECKS)}")
    arms = [parse_arm(a) for a in c.arms]
    if arms and arms[0].name != "float32":
        raise ValueError(f"arms={c.arms}: the first arm must be 'float32' (the reference)")
    if not arms and not c.exact_checks:
        raise ValueError("arms=() and exact_checks=(): nothing to run")
    return arms


def arm_model(arm: Arm, config, params):
    """``(model config, params)`` of an arm (bfloat16 params; a window on every layer)."""
    import jax
    import jax.numpy as jnp

    if arm.dtype == "bfloat16":
        config = dataclasses.replace(config, dtype="bfloat16")
        params = jax.tree.map(lambda x: np.asarray(x, jnp.bfloat16), params)
    if arm.window is not None:
        config = dataclasses.replace(config, sliding_window=arm.window)
    return config, params


def make_engine(c, arm: Arm, config, params, max_model_len: int | None = None, **overrides):
    from paged import Engine, EngineConfig

    granularity = arm.granularity if arm.granularity in QUANT_GRANULARITIES else "token"
    fields = dict(model=c.model, dtype=arm.dtype, kv_cache_dtype=arm.kv_cache_dtype,
                  kv_scale_granularity=granularity, block_size=c.block_size,
                  max_model_len=max_model_len, max_num_seqs=4,
                  max_num_batched_tokens=c.max_num_batched_tokens)
    ec = EngineConfig(**{**fields, **overrides})
    return Engine(ec, model_config=config, params=params)


def perplexity(engine, chunk_sets: dict[int, list[list[int]]]) -> dict:
    """Per chunk length: token-weighted perplexity from the engine's prompt log-probabilities."""
    from paged import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    out = {}
    for length, chunk_list in chunk_sets.items():
        nll = []
        for ids, res in zip(chunk_list, engine.generate(chunk_list, sp), strict=True):
            lps = res.prompt_logprobs
            nll.extend(-lps[i][ids[i]] for i in range(1, len(ids)))
        out[str(length)] = {"perplexity": float(np.exp(np.mean(nll))),
                            "nll_mean": float(np.mean(nll)), "tokens": len(nll)}
    return out


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def dense_logprobs(arm: Arm, config, params, chunk_list, block_size: int) -> list[np.ndarray]:
    """The no-cache forward's next-token log-probabilities with the arm's KV reproduced."""
    import jax
    import jax.numpy as jnp

    from paged.models.llama import Llama

    kv_quant = None if arm.kv_cache_dtype == "auto" else (
        arm.kv_cache_dtype, arm.granularity, block_size)
    fn = jax.jit(lambda p, t: Llama(config).apply(p, t, method="dense", kv_quant=kv_quant))
    return [_log_softmax(fn(params, jnp.asarray([ids], jnp.int32))[0]) for ids in chunk_list]


def fidelity(ref: list[np.ndarray], got: list[np.ndarray]) -> dict:
    kl, top1 = [], []
    for a, b in zip(ref, got, strict=True):
        kl.extend(np.sum(np.exp(a) * (a - b), axis=-1))
        top1.extend(a.argmax(-1) == b.argmax(-1))
    return {"kl_mean": float(np.mean(kl)), "kl_p99": float(np.quantile(kl, 0.99)),
            "top1_agreement": float(np.mean(top1)), "positions": len(kl)}


def retrieval(engine, needle_list) -> tuple[dict, list]:
    """Exact-match accuracy per (length, depth), and the raw outputs."""
    from paged import SamplingParams

    # digits are single tokens: "The secret code of X is NNNNNN." takes about 16
    sp = SamplingParams(max_tokens=24, temperature=0.0, logprobs=1)
    outs = engine.generate([n.prompt_ids for n in needle_list], sp)
    cells: dict[str, list[bool]] = {}
    for n, o in zip(needle_list, outs, strict=True):
        cells.setdefault(f"{n.length}@{n.depth}", []).append(n.answer in o.text)
    acc = {k: float(np.mean(v)) for k, v in cells.items()}
    acc["all"] = float(np.mean([v for vs in cells.values() for v in vs]))
    return acc, outs


def _dense_row(c, arm: Arm, config, params, tok, chunk_sets, needle_list) -> dict:
    from experiments import quality_dense

    kv_quant = (arm.kv_cache_dtype, arm.granularity, c.block_size)
    return {"arm": arm.name, **dataclasses.asdict(arm), "source": "dense (no cache)",
            "perplexity": quality_dense.perplexity(config, params, chunk_sets, kv_quant),
            "retrieval": quality_dense.retrieval(config, params, tok, needle_list, kv_quant)}


def run_arms(c, arms: list[Arm], config, params, tok, corpus: list[int]) -> tuple[list, dict]:
    """Perplexity, retrieval and fidelity per arm; returns the rows and the inputs' facts."""
    chunk_sets = {n: tasks.chunks(corpus, n, c.num_chunks) for n in c.chunk_lengths}
    fid_chunks = tasks.chunks(corpus, c.fidelity_length, c.fidelity_chunks)
    needle_list = [n for length in c.needle_lengths for d in c.needle_depths
                   for n in tasks.needles(tok, corpus, length, d, c.needles_per_cell, c.seed)]
    max_len = max(max(c.chunk_lengths), max(len(n.prompt_ids) for n in needle_list)) + 32
    max_len = -(-max_len // c.block_size) * c.block_size
    ref = dense_logprobs(arms[0], config, params, fid_chunks, c.block_size)
    rows = []
    with common.Progress(len(arms), "quality", unit="arms") as bar:
        for arm in arms:
            t = time.perf_counter()
            cfg, prm = arm_model(arm, config, params)
            if arm.granularity == "kivi":  # the dense forward (experiments.quality_dense)
                row = _dense_row(c, arm, cfg, prm, tok, chunk_sets, needle_list)
            else:
                engine = make_engine(c, arm, cfg, prm, max_len)
                row = {"arm": arm.name, **dataclasses.asdict(arm),
                       "perplexity": perplexity(engine, chunk_sets)}
                row["retrieval"], _ = retrieval(engine, needle_list)
            got = ref if arm.name == "float32" else dense_logprobs(arm, cfg, prm, fid_chunks,
                                                                    c.block_size)
            row["fidelity"] = fidelity(ref, got)
            row["seconds"] = time.perf_counter() - t
            rows.append(row)
            ppl = " ".join(f"ppl@{k} {v['perplexity']:.3f}" for k, v in row["perplexity"].items())
            print(f"{arm.name:<16} {ppl} KL {row['fidelity']['kl_mean']:.2e} top1 "
                  f"{row['fidelity']['top1_agreement']:.4f} retrieval {row['retrieval']['all']:.2f}",
                  flush=True)
            bar.update()
    needle = {"template": "The secret code of {name} is {number}.",
              "question": tasks.QUESTION, "scoring": "answer contains the number",
              "prompt_tokens": sorted({len(n.prompt_ids) for n in needle_list})}
    return rows, needle


def main(c, arms: list[Arm]) -> None:
    from paged.models.registry import load_any

    out_dir = common.output_dir(c, "quality")
    t0 = time.perf_counter()
    config, params, tok = load_any(c.model)
    text = tasks.corpus_text()
    corpus = tok.encode(text, add_bos=False)
    rows, needle = run_arms(c, arms, config, params, tok, corpus) if arms else ([], None)
    ref = Arm("float32")
    checks = exact.run_checks(
        c.exact_checks, lambda **kw: make_engine(c, ref, config, params, **{**exact.SHAPE, **kw}),
        corpus) if c.exact_checks else {}
    payload = {
        "study": "quality", "model": c.model, "config": c.to_dict(),
        "evidence": {"perplexity": "real", "fidelity": "real", "retrieval": "constructed",
                     "exact_checks": "real"},
        "corpus": tasks.corpus_info(text, len(corpus)), "needle": needle,
        "rows": rows, "exact_checks": checks, "seconds": time.perf_counter() - t0,
    }
    path = common.write_result(out_dir / "quality.json", payload)
    if rows:
        plot(rows, out_dir / "quality.png")
    print(f"wrote {path}")


def plot(rows, path) -> None:
    from experiments.plots import pyplot, save

    plt = pyplot()
    lengths = list(rows[0]["perplexity"])
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    names = [r["arm"] for r in rows]
    x = np.arange(len(rows))
    for j, n in enumerate(lengths):
        axes[0].bar(x + j * 0.8 / len(lengths), [r["perplexity"][n]["perplexity"] for r in rows],
                    0.8 / len(lengths), label=f"{n} tokens")
    axes[0].set_title("perplexity (engine)")
    axes[0].legend(fontsize=7)
    axes[1].bar(x, [max(r["fidelity"]["kl_mean"], 1e-12) for r in rows])
    axes[1].set_yscale("log")
    axes[1].set_title("KL(float32 || arm), mean")
    axes[2].bar(x, [r["retrieval"]["all"] for r in rows])
    axes[2].set_title("retrieval exact match")
    for ax in axes:
        ax.set_xticks(x, names, rotation=45, ha="right", fontsize=7)
    save(fig, path)


if __name__ == "__main__":
    common.run("quality", main, check)
