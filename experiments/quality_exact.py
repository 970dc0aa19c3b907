"""The exactness checks of `experiments/quality.py`: KV mechanisms that must not change the model's
outputs, run on the real model as checks (pass / fail with the largest difference), not figures.

Each check serves one short workload (``prompts``: a shared corpus prefix then a distinct corpus
suffix per prompt, two rounds of the same prompts, greedy, ``logprobs=1``) on an engine with the
mechanism on, and compares the greedy tokens and their log-probabilities with the plain engine
(float32, no prefix caching, no cascade, a pool that never preempts, no speculation). A check
passes when every token is identical, every log-probability differs by at most ``tolerance``
(0: bitwise equal; cascade: float32 rounding, its two attention passes merged by their log-sum-exp
round differently from one pass) and the mechanism really ran (``evidence``: counters that must
be > 0, e.g. prefix-cache hit tokens, cascade steps, preemptions, accepted draft tokens).
Speculation proposes only for requests that ask for no log-probabilities
(`paged.engine.spec_decode`), so its checks compare tokens only. Every engine of a check has one step shape
(token and sequence buckets pinned to the batch limits), so a difference is the mechanism's, not
a different matmul shape's. A mechanism the support matrix refuses for this model / config
(``paged.config.support``) is recorded as ``refused`` with the matrix's reason.

A new check is one entry of ``CHECKS``: its name, the ``EngineConfig`` fields it changes, the
counters that show it ran, and its tolerance.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

BLOCK = 16
SHAPE = dict(block_size=BLOCK, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
             min_token_bucket=64, min_seq_bucket=4)
TIGHT_BLOCKS = 14  # four running sequences need up to 28: preemption is certain
HOST_BYTES = 64 << 20  # host tier: room for every block of the workload
CASCADE_ROUNDING = 1e-4  # float32: prefix and suffix softmax passes merged vs one pass


def _kv(*path) -> Callable:
    def read(engine):
        x = engine.kv_stats()
        for p in path:
            x = x[p]
        return x
    return read


def _spec_stat(key: str) -> Callable:
    return lambda engine: engine.spec_decode_stats()[key]


@dataclasses.dataclass(frozen=True)
class ExactCheck:
    """One mechanism that must change nothing.

    Attributes:
      name: the check's name in ``config.exact_checks``.
      overrides: ``EngineConfig`` fields set on top of the plain engine's.
      evidence: ``{counter name: engine -> number}``; each must be > 0 after the run.
      tolerance: the largest log-probability difference allowed (0.0: bitwise).
      logprobs: compare log-probabilities too (False: tokens only, the requests ask for none).
      note: what the check exercises (written with the result).
    """

    name: str
    overrides: Callable[[], dict]
    evidence: dict
    tolerance: float = 0.0
    logprobs: bool = True
    note: str = ""


def _spec(method: str, **kw):
    from paged import SpeculativeConfig

    return SpeculativeConfig(method=method, **kw)


CHECKS: dict[str, ExactCheck] = {c.name: c for c in (
    ExactCheck("prefix_caching", lambda: dict(enable_prefix_caching=True),
               {"prefix_cache_hit_tokens": _kv("prefix_cache_hit_tokens")},
               note="the second round hits the prefix cache (and later prompts the shared prefix)"),
    ExactCheck("cascade", lambda: dict(enable_prefix_caching=True, cascade_attention="on"),
               {"cascade_steps": _kv("cascade", "steps")}, tolerance=CASCADE_ROUNDING,
               note="decode steps attend to the shared prefix once per group (prefix + suffix "
                    "passes merged by their log-sum-exp)"),
    ExactCheck("host_tier", lambda: dict(enable_prefix_caching=True, num_blocks=TIGHT_BLOCKS,
                                         host_kv_cache_bytes=HOST_BYTES),
               {"host_hit_tokens": _kv("host_tier", "hit_tokens")},
               note="a device pool too small for the workload: evicted prefix blocks are "
                    "offloaded to host memory and loaded back in the second round"),
    ExactCheck("preemption_recompute", lambda: dict(num_blocks=TIGHT_BLOCKS),
               {"num_preemptions": _kv("num_preemptions")},
               note="a pool too small for four running sequences: preempted ones recompute"),
    ExactCheck("preemption_swap", lambda: dict(num_blocks=TIGHT_BLOCKS, preemption_mode="swap"),
               {"num_swap_outs": _kv("num_swap_outs")},
               note="the same pool; preempted sequences' pages are swapped to host and back"),
    ExactCheck("speculation_ngram",
               lambda: dict(speculative=_spec("ngram", num_speculative_tokens=4)),
               {"draft_tokens": _spec_stat("num_draft_tokens")}, logprobs=False,
               note="prompt-lookup proposals of up to 4 tokens verified in one step (whether "
                    "the text repeats enough for a proposal to be accepted is the text's)"),
    ExactCheck("speculation_draft",
               lambda: dict(speculative=_spec("draft", model="smollm2-135m",
                                              num_speculative_tokens=3)),
               {"accepted_tokens": _spec_stat("num_accepted_tokens")}, logprobs=False,
               note="a draft model (the same SmolLM2 file: the only model with its vocabulary "
                    "here) proposes 3 tokens, the target verifies them in one step"),
)}


def prompts(corpus: list[int], num: int = 6, prefix: int = 48, seed: int = 0) -> list[list[int]]:
    """``num`` short prompts: one shared ``prefix``-token corpus prefix (3 whole blocks), then a
    distinct 8-40 token corpus suffix each (from later offsets)."""
    rng = np.random.default_rng(seed)
    head = corpus[:prefix]
    out = []
    for _ in range(num):
        n = int(rng.integers(8, 41))
        start = int(rng.integers(prefix, len(corpus) - n))
        out.append(head + corpus[start:start + n])
    return out


def _run(engine, batch, sp) -> list:
    """Two rounds of ``batch``: ``(token ids, their log-probabilities or [])`` per request."""
    out = []
    for _ in range(2):
        for o in engine.generate(batch, sp):
            c = o.outputs[0]
            lps = [] if c.logprobs is None else [lp[t] for lp, t in zip(c.logprobs, c.token_ids)]
            out.append((list(c.token_ids), lps))
    return out


def compare(got: list, want: list) -> tuple[bool, float]:
    """``(every token identical, largest |log-probability difference| over equal tokens)``."""
    same = len(got) == len(want) and all(g[0] == w[0] for g, w in zip(got, want))
    diffs = [abs(a - b) for g, w in zip(got, want) for a, b in zip(g[1], w[1])]
    return same, float(max(diffs, default=0.0))


def run_checks(names, make_engine, corpus: list[int], max_tokens: int = 16) -> dict:
    """Runs the checks ``names``; ``make_engine(**fields)`` builds a float32 engine of the real
    model with ``SHAPE`` and the given ``EngineConfig`` fields. Returns ``{name: outcome}``;
    raises AssertionError naming every failed check (after running all of them)."""
    from paged import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    tokens_only = dataclasses.replace(sp, logprobs=None)
    batch = prompts(corpus)
    plain_fields = dict(enable_prefix_caching=False)
    plain = _run(make_engine(**plain_fields), batch, sp)
    results = {}
    for name in names:
        check = CHECKS[name]
        fields = {**plain_fields, **check.overrides()}
        base = {"note": check.note, "settings": {k: str(v) for k, v in fields.items()},
                "tolerance": check.tolerance}
        try:
            engine = make_engine(**fields)
        except ValueError as e:
            if "[refused pair:" not in str(e):
                raise
            results[name] = {**base, "status": "refused", "reason": str(e)}
            continue
        same, worst = compare(_run(engine, batch, sp if check.logprobs else tokens_only), plain)
        evidence = {k: int(f(engine)) for k, f in check.evidence.items()}
        ok = same and worst <= check.tolerance and all(v > 0 for v in evidence.values())
        results[name] = {**base, "status": "passed" if ok else "failed",
                         "identical_tokens": same,
                         "max_abs_logprob_diff": worst if check.logprobs else None,
                         "evidence": evidence, "requests": 2 * len(batch),
                         "tokens": 2 * len(batch) * max_tokens}
        lp = f"max |dlogprob| {worst:.2e}" if check.logprobs else "tokens only"
        print(f"exact check {name:<22} {results[name]['status']}: tokens "
              f"{'identical' if same else 'DIFFER'}, {lp}, {evidence}", flush=True)
    failed = {k: v for k, v in results.items() if v["status"] == "failed"}
    if failed:
        raise AssertionError(f"exact checks failed: {failed}")
    return results
