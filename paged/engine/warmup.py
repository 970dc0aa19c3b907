"""Compiling every step an engine can run before it serves (``Engine.warmup``), and the small
default bucket set of a server start.

A step's compiled shape is (token bucket, sequence bucket, sample-slot bucket) and its variant is
(log-probabilities on/off, speculative verify on/off) (`paged.engine.device_step.make_step_fn`). What a
request selects:

- a plain request: the plain variant at the step's buckets;
- ``logprobs`` (any k: the step always returns the top ``MAX_LOGPROBS``), chat
  ``top_logprobs``: the log-probability variant at the same buckets;
- ``prompt_logprobs``: that variant, but a step that scores more prompt tokens than its
  sequence bucket has more sample slots (up to the token bucket) and then feeds the next step a
  longer ``prev``: NOT covered, those compile on first use;
- ``n > 1``: the forked prompt samples n slots, so the sample-slot bucket may exceed the sequence
  bucket (up to ``next_pow2(max_num_seqs)``: resident samples never exceed ``max_num_seqs``);
- n-gram speculation: the verify variant (with and without log-probabilities), sample slots from
  the sequence bucket up to the token bucket;
- ``cascade_attention`` on or auto: a decode-only step that serves shared-prefix groups carries
  their metadata (``paged.step.cascade_plan``, i32[G, S + 1]), one more compiled shape per decode-only
  bucket with two or more sequences, plain and log-probability variants; listed as
  ``(tokens, sequences, slots, True)``.

`plan` lists all of them (``logprobs=False`` / ``parallel_sampling=False`` leave out what a
workload never asks for); `run` says in one line how many it will compile, refuses more than
``max_shapes`` (the library defaults, ``EngineConfig()``, plan 244: ``server_buckets`` or larger
``min_token_bucket`` / ``min_seq_bucket`` bound them), compiles them on all-padding batches (no KV
touched), with a `paged.util.progress_bar.Progress` line per shape, then the copy-on-write page
copies that ``n > 1`` forks need (`copy_sizes`: null page onto itself). Not covered: a draft
model's own calls (speculation with ``method="draft"``) compile on their first use.
"""

from __future__ import annotations

import sys

from paged.kv import cache as kc
from paged.kv.paging import NULL_PAGE, next_pow2
from paged.util.progress_bar import Progress

MAX_SHAPES = 128  # `run`'s default bound: about 2-4 s a shape for the tiny model on 2 CPU cores

PLAIN, LOGPROBS, VERIFY, VERIFY_LOGPROBS = (False, False), (True, False), (False, True), (True, True)
_NAMES = {PLAIN: "plain", LOGPROBS: "logprobs", VERIFY: "verify", VERIFY_LOGPROBS: "verify+logprobs"}


def _pow2s(lo: int, hi: int) -> list[int]:
    return [1 << i for i in range(hi.bit_length()) if lo <= 1 << i <= hi]


def plan(engine, *, logprobs: bool = True, parallel_sampling: bool = True) -> list[tuple]:
    """Every (variant, (tokens, sequences, sample slots)) the engine's steps can take."""
    config, builder = engine.config, engine.builder
    budget = (config.max_num_batched_tokens, config.max_num_seqs)
    top = next_pow2(max(config.max_num_seqs, config.min_seq_bucket))
    shapes = set(builder.all_shapes(*budget))
    if parallel_sampling:
        shapes |= {builder.buckets(t, s, n) for t, s, _ in list(shapes) for n in _pow2s(s, top)}
    variants = [PLAIN] + ([LOGPROBS] if logprobs else [])
    out = [(v, shape) for v in variants for shape in sorted(shapes)]
    planner = builder.cascade
    if planner is not None and planner.mode != "off":
        pow2s = _pow2s(1, next_pow2(config.max_num_seqs))
        decode_only = sorted({builder.buckets(s, s, s) for s in pow2s})
        out += [(v, (*shape, True)) for v in variants for shape in decode_only if shape[1] >= 2]
    spec = engine.speculator
    if spec is not None and spec.draft is None:
        verify = sorted(builder.verify_shapes(*budget))
        out += [(v, shape) for v in [VERIFY] + ([VERIFY_LOGPROBS] if logprobs else [])
                for shape in verify]
    return out


def copy_sizes(engine, *, parallel_sampling: bool = True) -> list[int]:
    """The padded page counts of a step's copy-on-write copies (``kv.cache.copy_pages``): a
    forked sequence copies at most its one shared partial page per KV group and step, so up to
    ``max_num_seqs`` x groups pages, padded to powers of two. None without ``n > 1``."""
    if not parallel_sampling:
        return []
    groups = len(getattr(engine.block_manager, "groups", [None]))
    top = min(next_pow2(engine.config.max_num_seqs * groups), next_pow2(engine.cache.num_pages))
    return _pow2s(1, top)


def _compile_copies(engine, n: int) -> None:
    """Copies the null page onto itself ``n`` times on the engine's caches (draft included, and
    announced to multi-host followers as a step's copies are): compiles ``copy_pages`` at ``n``."""
    null = [NULL_PAGE] * n
    if engine.leader is not None:
        engine.leader.copies(_NullCopies(list(zip(null, null))), [])
    draft = None if engine.speculator is None else engine.speculator.draft
    if draft is not None:
        draft.cache = kc.copy_pages(draft.cache, null, null)
    engine.cache = kc.copy_pages(engine.cache, null, null)


class _NullCopies:
    """The part of a ``SchedulerOutput`` a leader announces: copies only."""

    swap_out = swap_in = ()

    def __init__(self, copies):
        self.copies = copies


def run(engine, *, logprobs: bool = True, parallel_sampling: bool = True,
        progress: bool = False, desc: str = "warmup", max_shapes: int | None = MAX_SHAPES) -> int:
    """Compiles `plan`'s steps and the `copy_sizes` copies; returns how many compilations that
    took (shapes already compiled, by this engine or another with the same model, cost none).
    Prints one line first (stderr): how many step shapes and copy sizes it will compile.
    ``progress``: one line per shape (``warmup 3/8 step shapes, 9.8 s (64x32x32 logprobs)``)
    off a terminal, a bar on one.

    Raises:
      RuntimeError: requests are in the engine.
      ValueError: the plan has more than ``max_shapes`` step shapes (``None``: no bound); the
        message names the count and the knobs that bound it. Nothing is compiled then.
    """
    if engine.has_unfinished_requests():
        raise RuntimeError("warmup() must run before requests are added")
    steps = plan(engine, logprobs=logprobs, parallel_sampling=parallel_sampling)
    copies = copy_sizes(engine, parallel_sampling=parallel_sampling)
    c = engine.config
    buckets = f"min_token_bucket={c.min_token_bucket}, min_seq_bucket={c.min_seq_bucket}"
    if max_shapes is not None and len(steps) > max_shapes:
        bounded = server_buckets(c, set())
        raise ValueError(
            f"warmup would compile {len(steps)} step shapes ({buckets}), more than "
            f"max_shapes={max_shapes} (about 2-4 s each on CPU for the tiny model): bound them "
            f"with EngineConfig(min_token_bucket={bounded.min_token_bucket}, "
            f"min_seq_bucket={bounded.min_seq_bucket}) (what "
            f"paged.engine.warmup.server_buckets(config, set()) returns, as a server start "
            f"uses), or pass logprobs=False / parallel_sampling=False if no request asks for "
            f"them, or max_shapes=None to compile them all")
    print(f"{desc}: compiling {len(steps)} step shapes ({buckets}) and "
          f"{len(copies)} copy-on-write sizes", file=sys.stderr, flush=True)
    before = engine.trace_count()
    with Progress(len(steps), desc, unit="step shapes", enabled=progress, lines=True,
                  summary=False) as bar:
        for i, (variant, shape) in enumerate(steps):
            engine.compile_step(variant, shape)
            bar.set(i + 1, shape="x".join(map(str, shape[:3])) + " " + _NAMES[variant]
                    + (" cascade" if len(shape) > 3 else ""))
    for n in copies:
        _compile_copies(engine, n)
    n = engine.trace_count() - before
    engine.warm_tier()  # the host tier's copies, at every padded page count
    return n


def server_buckets(config, given: set[str]):
    """The config a server start uses: ``config`` with a small bucket set derived from its budgets
    unless the user set ``min_token_bucket`` or ``min_seq_bucket`` (named in ``given``).

    One sequence bucket (``min_seq_bucket = max_num_seqs``: padding rows cost little, and forks
    then add no sample-slot shape) and two token buckets, half the token budget and the budget
    (``min_token_bucket = max(next_pow2(max_num_seqs), next_pow2(min(max_num_batched_tokens,
    max_model_len * max_num_seqs)) // 2)``; a decode-only step fits the smaller). With the plain
    and the log-probability variant that is 4 compilations (17 s measured on 2 CPU cores).
    """
    import dataclasses

    if given & {"min_token_bucket", "min_seq_bucket"}:
        return config
    seqs = config.max_num_seqs
    tokens = next_pow2(min(config.max_num_batched_tokens, config.max_model_len * seqs))
    return dataclasses.replace(config, min_seq_bucket=seqs,
                               min_token_bucket=max(next_pow2(seqs), tokens // 2))
