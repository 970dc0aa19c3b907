"""Speculative decoding (n-gram and draft-model proposals): acceptance, tokens per verify step,
wall speed-up.

For each method, each k (``num_speculative_tokens``) and each constructed prompt kind (code-like,
prose-like; ``evidence: constructed``), at batch 1: the acceptance rate alpha per judged draft
(accepted / (accepted + rejections); vLLM's accepted / proposed is ``draft_acceptance_rate``),
the mean tokens emitted per verify step beside the expectation (1 - alpha^(k+1)) / (1 - alpha) for
k proposals accepted independently with probability alpha, the proposer's cost ratio c (time
spent proposing per proposal, over one plain target step: host lookup for n-gram, the draft
model's steps and cache mirroring for a draft model, measured), and the wall speed-up over plain decoding beside the
predicted (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)). Then throughput at larger batches with
speculation on and off, to show where it stops paying. Runs are greedy, so every speculative run
must produce exactly the plain run's tokens (checked). Plain and speculative runs alternate, and
medians over ``repeats`` are reported.

Caveat: n-gram proposals can only be as long as what the sequence already repeats; the expected
length assumes proposals of full length k, so ``proposal_fill`` (proposed / (k x verify rows))
says how far that assumption holds.
"""

from __future__ import annotations

import time

import numpy as np

from experiments import common
from paged import Engine, SamplingParams, SpeculativeConfig

CODE = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
]
PROSE = [
    "The history of the city begins with a small settlement on the river, where traders met",
    "She walked along the shore in the early morning, thinking about the letter she had read",
    "In the spring the fields turn green again and the farmers return to their work, hoping",
]


def check(c) -> dict:
    common.check_model(c.model)
    common.check_unset(c.engine, ["speculative", "max_num_seqs"], "ks / batch_sizes")
    methods = tuple(c.methods)
    if not methods or any(m not in ("ngram", "draft") for m in methods):
        raise ValueError(f"methods={methods!r} must name 'ngram' and/or 'draft'")
    for key in ("ks", "batch_sizes"):
        if not c[key] or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in c[key]):
            raise ValueError(f"{key}={tuple(c[key])!r} must be positive integers")
    common.check_positive(max_tokens=c.max_tokens, repeats=c.repeats)
    spec = {(m, k): SpeculativeConfig(method=m, model=c.draft_model, num_speculative_tokens=k,
                                      ngram_min=c.ngram_min, ngram_max=c.ngram_max)
            for m in methods for k in c.ks}
    configs = {}
    for b in sorted(set(c.batch_sizes) | {1}):
        configs[b, None] = common.make_engine_config(c.engine, model=c.model, max_num_seqs=b,
                                                     async_scheduling=False)
        for (m, k), s in spec.items():
            configs[b, m, k] = common.make_engine_config(c.engine, model=c.model, max_num_seqs=b,
                                                         speculative=s)
    return {"configs": configs}


def _timed(obj, name: str, total: list[float]):
    """Wraps ``obj.name`` so its calls add their wall time to ``total[0]``; returns the original."""
    inner = getattr(obj, name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        out = inner(*args, **kwargs)
        if name == "mirror":  # dispatch is asynchronous: count the device work too
            obj.cache.k_pages.block_until_ready()
        total[0] += time.perf_counter() - t
        return out

    setattr(obj, name, timed)
    return inner


def _run(engine: Engine, prompts: list[str], c) -> tuple[list[list[int]], float, int, float]:
    """Tokens, wall seconds, steps and proposing seconds of one greedy run."""
    params = SamplingParams(max_tokens=c.max_tokens, temperature=0.0, ignore_eos=True)
    steps0 = engine.num_steps
    propose = [0.0]
    spec = engine.speculator
    wrapped = []
    if spec is not None:  # time the proposing alone
        if spec.draft is None:
            wrapped.append((spec.proposer, "propose", _timed(spec.proposer, "propose", propose)))
        else:
            wrapped.append((spec, "draft_tokens", _timed(spec, "draft_tokens", propose)))
            wrapped.append((spec.draft, "mirror", _timed(spec.draft, "mirror", propose)))
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    for obj, name, inner in wrapped:
        setattr(obj, name, inner)
    return [o.token_ids for o in outs], wall, engine.num_steps - steps0, propose[0]


def main(c, plan):
    out_dir = common.output_dir(c, "spec_decode")
    model_config, params = common.load_model(c.model)
    engines = {key: Engine(cfg, model_config=model_config, params=params)
               for key, cfg in plan["configs"].items()}
    kinds = {"code": CODE, "prose": PROSE}
    for key, e in engines.items():  # compile the shapes each arm will see
        b = key[0]
        for kind in kinds.values():
            _run(e, (kind * b)[:b], c)
    rows = []
    methods = tuple(c.methods)
    arms = [(m, kind, 1, k) for m in methods for kind in kinds for k in c.ks]
    arms += [(m, "code", b, k) for m in methods for b in c.batch_sizes if b > 1 for k in c.ks]
    progress = common.Progress(len(arms), "spec_decode", unit="arm")
    for m, kind, b, k in arms:
        prompts = (kinds[kind] * b)[:b]
        plain, spec = engines[b, None], engines[b, m, k]
        walls, swalls, props, steps_p, steps_s = [], [], [], [], []
        before = spec.spec_decode_stats()
        for _ in range(c.repeats):  # interleaved
            want, w, n_plain, _ = _run(plain, prompts, c)
            got, sw, n_spec, prop = _run(spec, prompts, c)
            if got != want:
                raise AssertionError(f"speculation changed greedy tokens ({kind}, b={b}, k={k})")
            walls.append(w)
            swalls.append(sw)
            props.append(prop)
            steps_p.append(n_plain)
            steps_s.append(n_spec)
        after = spec.spec_decode_stats()
        drafts = after["num_drafts"] - before["num_drafts"]
        proposed = after["num_draft_tokens"] - before["num_draft_tokens"]
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        emitted = after["num_emitted_tokens"] - before["num_emitted_tokens"]
        rejected = after["num_rejections"] - before["num_rejections"]
        # Per judged draft: the drafts after a rejection are never judged.
        alpha = accepted / (accepted + rejected) if accepted + rejected else 0.0
        rate = accepted / proposed if proposed else 0.0
        expected = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1.0
        step_s = float(np.median(walls)) / max(1, int(np.median(steps_p)))  # one target step
        # Per proposed token (a draft model's step makes one per sequence), per plain step.
        cost = float(np.median(props)) / max(1, proposed // c.repeats // b) / step_s
        predicted = expected / (k * cost + 1)
        rows.append({
            "method": m, "prompts": kind, "batch": b, "k": k, "alpha": alpha,
            "draft_acceptance_rate": rate,
            "verify_rows": drafts, "proposal_fill": proposed / (k * drafts) if drafts else 0.0,
            "mean_emitted_per_verify": emitted / drafts if drafts else 0.0,
            "expected_emitted_per_verify": expected, "draft_cost_ratio_c": cost,
            "plain_wall_s": float(np.median(walls)), "spec_wall_s": float(np.median(swalls)),
            "speedup": float(np.median(walls)) / float(np.median(swalls)),
            "predicted_speedup": predicted,
            "plain_steps": int(np.median(steps_p)), "spec_steps": int(np.median(steps_s)),
            "plain_tokens_per_s": b * c.max_tokens / float(np.median(walls)),
            "spec_tokens_per_s": b * c.max_tokens / float(np.median(swalls)),
        })
        progress.set(len(rows), arm=f"{m} {kind} b={b} k={k}")
    progress.close()
    for r in rows:
        print(f"{r['method']:5s} {r['prompts']:5s} b={r['batch']:3d} k={r['k']}  alpha {r['alpha']:.2f}  tokens/verify "
              f"{r['mean_emitted_per_verify']:.2f} (expected {r['expected_emitted_per_verify']:.2f}, "
              f"fill {r['proposal_fill']:.2f})  speed-up {r['speedup']:.2f} (predicted "
              f"{r['predicted_speedup']:.2f}, c {r['draft_cost_ratio_c']:.3f})")
    path = common.write_json(out_dir / "spec_decode.json", {
        "study": "spec_decode", "evidence": "constructed", "config": c.to_dict(),
        "prompts": kinds, "results": rows, "provenance": common.provenance()})
    _plot(rows, c, out_dir)
    print(f"wrote {path}")


def _plot(rows, c, out_dir) -> None:
    common.quiet_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for m, kind in sorted({(r["method"], r["prompts"]) for r in rows}):
        rs = [r for r in rows if r["prompts"] == kind and r["batch"] == 1 and r["method"] == m]
        kind = f"{m} {kind}"
        ks = [r["k"] for r in rs]
        axes[0].plot(ks, [r["mean_emitted_per_verify"] for r in rs], "o-", label=f"{kind} measured")
        axes[0].plot(ks, [r["expected_emitted_per_verify"] for r in rs], "--", label=f"{kind} expected")
        axes[1].plot(ks, [r["speedup"] for r in rs], "o-", label=f"{kind} measured")
        axes[1].plot(ks, [r["predicted_speedup"] for r in rs], "--", label=f"{kind} predicted")
    for m, b in sorted({(r["method"], r["batch"]) for r in rows if r["batch"] > 1}):
        rs = [r for r in rows if r["batch"] == b and r["method"] == m]
        axes[1].plot([r["k"] for r in rs], [r["speedup"] for r in rs], "s:", label=f"{m} code b={b}")
    axes[0].set(xlabel="k", ylabel="tokens per verify step", title="batch 1")
    axes[1].set(xlabel="k", ylabel="wall speed-up vs plain")
    axes[1].axhline(1.0, color="gray", lw=0.5)
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "spec_decode.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    common.run("spec_decode", main, check)
