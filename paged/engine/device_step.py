"""The engine's device step: two jitted calls, the model forward (KV written into the donated
cache, the sample slots' logits out) and the sampler (compiled per sample-slot count and
vocabulary, shared by every step shape and engine); the draft model's calls; the device copies."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from paged.engine import sampler as sampling
from paged.kv import cache as kc
from paged.kv import mass as kv_mass
from paged.kv import packed_cache
from paged.kv.cache import KVCache
from paged.kv.open_pages import OpenPages
from paged.models.config import LlamaConfig
from paged.models.kivi_attention import KiviPages
from paged.models.llama import Llama, attention_mass
from paged.models.sparse_attention import SparseDecode
from paged.step.sampling_rows import SamplingView


def device_cache(spec, num_pages: int, page_size: int, sharding=None,
                 open_slots: int = 0, attn_mass: bool = False) -> KVCache:
    """The device pool of a ``paged.kv.spec.KVSpec``: ``num_pages`` pages of ``page_size``
    tokens in its page format (``spec.page``: every layer, or one KV-cache group's ``L / G``),
    sharded by ``sharding``; a packed format (int4 / int2) also gets ``open_slots`` open pages
    in the model dtype (``paged.kv.open_pages``); ``attn_mass``: with each slot's attention mass
    (``paged.kv.mass``)."""
    page = spec.page
    return KVCache.create(page.num_layers, page.num_kv_heads, num_pages, page_size,
                          page.head_dim, page.dtype, sharding=sharding,
                          kv_cache_dtype=page.kv_cache_dtype,
                          scale_granularity=page.scale_granularity,
                          page_bounds=page.page_bounds,
                          open_slots=open_slots if page.packed_bits else 0,
                          attn_mass=attn_mass)


def open_pages(core, config, spec) -> OpenPages | None:
    """Packed pages (int4 / int2): the open-page slots, one per running sequence, wired into
    ``core``'s batch builder (which plans each step's ``KiviMeta``); None for other formats."""
    if not spec.page.packed_bits:
        return None
    bm = core.block_manager
    slots = OpenPages(config.max_num_seqs, core.page_size, lambda page: bm.refcount(page) > 0,
                      getattr(bm, "block_version", None))
    core.builder.open_pages = slots
    return slots


def step_functions(model_config: LlamaConfig, config, placement, leader=None) -> tuple:
    """An engine's jitted steps: ``(variants, called, trace_count, no_prev_tokens)``:
    ``(with_logprobs, with_verify) -> step`` as a follower process runs them, the same as this
    process calls them (a ``leader`` announces every call to the other processes), the count
    of traces so far (the forward's, the sampler's and the page copy / read / write functions'),
    and the tokens fed as "the previous step's" when no step is in flight."""
    out_size = kc.next_pow2(max(config.max_num_seqs, config.min_seq_bucket))
    sparse = _sparse_args(config)
    forward, forward_traces = make_forward(model_config, config.attention_impl, *sparse)
    variants = {v: compose(forward, make_sample_fn(out_size, *v))
                for v in itertools.product((False, True), repeat=2)}
    no_prev = placement.put(np.zeros(out_size, np.int32))
    called = dict(variants) if leader is None else {
        v: leader.wrap(f, v, no_prev) for v, f in variants.items()}
    count = lambda: forward_traces() + sample_trace_count() + kc.trace_count()
    return variants, called, count, no_prev


def _sparse_args(config) -> tuple:
    """``make_forward``'s sparse-decode arguments of an engine config."""
    sparse = config.sparse_decode
    if sparse is None:
        return None, 0, "max", 0
    return (sparse.budget(config.block_size), sparse.dense_layers, sparse.gqa,
            sparse.recent_pages)


def compose(forward, sample_fn):
    """The engine's step: two jitted calls, ``forward`` (the model, the KV written into the
    donated cache, the sample slots' logits out) then ``sample_fn`` on those logits and the
    batch's sampling parameters; ``(cache, tokens[, extras])`` as ``make_step_fn`` says."""

    def step(params, cache: KVCache, batch, prev, q=None, q_index=None):
        cache, logits = forward(params, cache, batch, prev)
        if q is None:
            return (cache, *sample_fn(logits, batch.smp, batch.smp_f))
        return (cache, *sample_fn(logits, batch.smp, batch.smp_f, q, q_index))

    return step


@functools.lru_cache(maxsize=32)
def make_step_fn(model_config: LlamaConfig, attention_impl: str, out_size: int = 1,
                 with_logprobs: bool = False, with_verify: bool = False,
                 sparse_budget: float | None = None, sparse_dense_layers: int = 0,
                 sparse_gqa: str = "max", sparse_recent: int = 0):
    """Returns ``(step, trace_count)``, shared by every engine with the same model and attention.

    ``step(params, cache, batch, prev) -> (cache, tokens i32[N])`` runs ``make_forward``'s
    jitted forward (the cache DONATED: XLA writes the new K/V in place and the caller must drop
    its old reference) and then ``make_sample_fn``'s jitted sampler on the sample slots' logits.
    ``prev`` is the previous step's ``tokens`` (still on device): a token row whose
    ``batch.feed`` is ``j >= 0`` takes ``prev[j]`` as its id, so a step can be dispatched before
    the previous one's samples reach the host. ``tokens`` is zero-padded to at least
    ``out_size`` slots, so that ``prev`` keeps one shape from step to step (it is not another
    dimension to compile for). With ``with_logprobs`` the step returns
    ``(cache, tokens, extras)``: ``extras`` holds, per sample slot, the log-probability of its
    ``batch.target`` token (the sampled token where the target is -1) and the slot's top
    ``MAX_LOGPROBS`` log-probabilities and ids (``sampling.logprobs``). With ``with_verify`` the
    tokens come from ``sampling.verify`` (``batch.draft``: each slot's proposed token, -1 where
    none; ``q``, ``q_index``: the drafts' distributions) and ``extras`` also holds each slot's
    accept bit. The sparse arguments are ``make_forward``'s. ``trace_count()`` says how many
    shapes the forward and the sampler traced so far (one XLA compilation each); engines sharing
    them share their compilations, so an engine reports the difference since its creation.
    """
    forward, traces = make_forward(model_config, attention_impl, sparse_budget,
                                   sparse_dense_layers, sparse_gqa, sparse_recent)
    step = compose(forward, make_sample_fn(out_size, with_logprobs, with_verify))
    return step, lambda: traces() + sample_trace_count()


def make_forward(model_config: LlamaConfig, attention_impl: str,
                 sparse_budget: float | None = None, sparse_dense_layers: int = 0,
                 sparse_gqa: str = "max", sparse_recent: int = 0):
    """Returns ``(forward, trace_count)``: the step's model half, one jitted call whatever the
    sampler does (the plain, log-probability and verify steps share its compilations).

    ``forward(params, cache, batch, prev) -> (cache, logits f32[N, V])``, the cache DONATED;
    ``logits`` are the N sample slots' rows only (``batch.sample_rows``). With
    ``sparse_budget`` (pages, or a fraction of each sequence's pages; the cache then holds key
    bounds) decode rows read the pages Quest selects (``paged.models.sparse_attention``; every
    page in the first ``sparse_dense_layers`` layers; ``sparse_gqa``: how a query group picks
    its pages; ``sparse_recent``: pages before the open page always read) and the step folds its
    new keys into the bounds. A KV policy's attention mass (``batch.mw``) is accumulated into the
    cache.
    """
    return _forward(model_config, attention_impl, sparse_budget, sparse_dense_layers, sparse_gqa,
                    sparse_recent)  # one cache key however the defaults were passed


@functools.lru_cache(maxsize=32)
def _forward(model_config, attention_impl, sparse_budget, sparse_dense_layers, sparse_gqa,
             sparse_recent):
    model = Llama(model_config)
    traces = [0]

    @functools.partial(jax.jit, donate_argnums=1)
    def step_forward(params, cache: KVCache, batch, prev):
        traces[0] += 1  # runs at trace time only
        feed = batch.feed
        ids = jnp.where(feed >= 0, prev[jnp.clip(feed, 0, prev.shape[0] - 1)], batch.tokens)
        md = batch.md
        if sparse_budget is not None:
            md = md.replace(sparse=SparseDecode(cache.key_bounds, sparse_budget,
                                                   sparse_dense_layers, sparse_gqa,
                                                   sparse_recent))
        k_pages, v_pages = cache.k_pages, cache.v_pages
        if cache.open_k is not None:  # packed pages travel with their open pages
            k_pages, v_pages = KiviPages(k_pages, cache.open_k), KiviPages(v_pages, cache.open_v)
        mass = None
        if batch.mw is not None and cache.attn_mass is not None:  # a KV policy's mass
            (logits, k_pages, v_pages), state = model.apply(
                params, ids, batch.positions, k_pages, v_pages,
                md.replace(mass_weight=batch.mw), batch.sample_rows,
                attention_impl=attention_impl, mutable=["intermediates"])
            mass = attention_mass(state["intermediates"], model_config.num_layers)
        else:
            logits, k_pages, v_pages = model.apply(
                params, ids, batch.positions, k_pages, v_pages, md,
                batch.sample_rows, attention_impl=attention_impl)
        if cache.open_k is not None:
            cache = cache.replace(open_k=k_pages.open, open_v=v_pages.open)
            k_pages, v_pages = k_pages.pool, v_pages.pool
        new_cache = kc.update_bounds(cache.replace(k_pages=k_pages, v_pages=v_pages),
                                     batch.md.slot_mapping)
        if mass is not None:
            new_cache = kv_mass.accumulate(new_cache, mass, md.page_indices, md.kv_lens,
                                           md.slot_mapping)
        return new_cache, logits

    return step_forward, lambda: traces[0]


_SAMPLE_TRACES = [0]


def sample_trace_count() -> int:
    """Shapes ``make_sample_fn``'s samplers traced so far in this process (all engines)."""
    return _SAMPLE_TRACES[0]


@functools.lru_cache(maxsize=32)
def make_sample_fn(out_size: int, with_logprobs: bool, with_verify: bool):
    """The step's sampler half, one jitted call shared by every engine and model: compiled once
    per (sample slots N, vocabulary V, ``out_size``, extras), never per step shape.

    ``sample_fn(logits f32[N, V], smp i32[7, N], smp_f f32[2, N], q=None, q_index=None) ->
    (tokens i32[max(N, out_size)],)`` or ``(tokens, extras)`` with log-probabilities or verify
    (``make_step_fn`` says what they hold); ``smp`` / ``smp_f`` are a ``DeviceBatch``'s
    sampling rows."""

    @jax.jit
    def step_sample(logits, smp, smp_f, q=None, q_index=None):
        _SAMPLE_TRACES[0] += 1  # runs at trace time only
        s = SamplingView(smp, smp_f)
        args = (logits, s.temperature, s.top_k, s.top_p, s.seed, s.sample_index, s.sample_pos)
        extras = {}
        if with_verify:
            tokens, extras["accept"] = sampling.verify(*args, s.draft, q, q_index)
        else:
            tokens = sampling.sample(*args)
        if with_logprobs:
            target = jnp.where(s.target >= 0, s.target, tokens)
            extras["logprobs"] = sampling.logprobs(logits, target)
        if tokens.shape[0] < out_size:
            tokens = jnp.pad(tokens, (0, out_size - tokens.shape[0]))
        return (tokens, extras) if extras else (tokens,)

    return step_sample


def stub_step(params, cache, batch, prev):
    """A device step that does no device work, for ``Engine.set_device_step``: zero tokens of the
    right shape (one per sample slot, at least ``prev``'s length), at once. Host-only benchmarks
    time the host's share of a step with it."""
    return cache, np.zeros(max(batch.sample_rows.shape[0], prev.shape[0]), np.int32)


def apply_copies(cache: KVCache, sched, host_k, host_v, freed_pages: list[int], tier=None,
                 tier_copies=None, open_pages: OpenPages | None = None) -> KVCache:
    """The device-side effects of scheduling, in an order that never loses live KV: swap-out
    and host-tier offload (read before anything can overwrite the freed or evicted pages), NaN
    poison of ``freed_pages`` (debug; the list is emptied), swap-in and host-tier loads (into
    fresh pages), copy-on-write. ``tier``: a ``paged.kv.host_store.HostTierStore`` with the
    step's ``tier_copies`` (``BlockManager.take_tier_copies``), or ``None``. ``open_pages``:
    packed pages' open-page slots: a copy-on-write of an open page copies its slot too, swap
    takes it to the host and back."""
    if sched.swap_out:
        pages, slots = map(list, zip(*sched.swap_out))
        k, v = kc.swap_out(cache, pages)
        kc.host_set(host_k, slots, k)
        kc.host_set(host_v, slots, v)
        if open_pages is not None:
            packed_cache.save_swapped(cache, open_pages, sched.swap_out)
    if tier is not None:
        cache = tier.apply(cache, tier_copies, phase="offload")
    if freed_pages:
        cache = kc.poison(cache, sorted(set(freed_pages)))
        freed_pages.clear()
    if sched.swap_in:
        slots, pages = map(list, zip(*sched.swap_in))
        cache = kc.swap_in(cache, pages, kc.host_get(host_k, slots), kc.host_get(host_v, slots))
        if open_pages is not None:
            cache = packed_cache.load_swapped(cache, open_pages, sched.swap_in)
    if tier is not None:
        cache = tier.apply(cache, tier_copies, phase="load")
    if sched.copies:
        src, dst = map(list, zip(*sched.copies))
        cache = kc.copy_pages(cache, src, dst)
        if open_pages is not None:
            cache = packed_cache.copy_open_slots(cache, open_pages.copy(sched.copies))
    return cache


@functools.lru_cache(maxsize=16)
def make_draft_fns(model_config: LlamaConfig, attention_impl: str):
    """A draft model's two jitted calls (its cache donated), on the target's batches and tables:

    ``forward(params, cache, batch) -> cache``: writes the batch's K/V (every target step runs it
    so the draft's cache covers what the target's does); ``propose(params, cache, batch) ->
    (cache, tokens i32[N], probs f32[N, V])``: also samples each slot from the draft's filtered
    distribution (a random stream apart from the target's) and returns that distribution.
    """
    model = Llama(model_config)

    def run(params, cache, batch):
        logits, k_pages, v_pages = model.apply(
            params, batch.tokens, batch.positions, cache.k_pages, cache.v_pages, batch.md,
            batch.sample_rows, attention_impl=attention_impl)
        return logits, cache.replace(k_pages=k_pages, v_pages=v_pages)

    @functools.partial(jax.jit, donate_argnums=1)
    def forward(params, cache, batch):
        return run(params, cache, batch)[1]

    @functools.partial(jax.jit, donate_argnums=1)
    def propose(params, cache, batch):
        logits, cache = run(params, cache, batch)
        tokens, probs = sampling.draft_sample(logits, batch.temperature, batch.top_k, batch.top_p,
                                              batch.seed, batch.sample_index, batch.sample_pos)
        return cache, tokens, probs

    return forward, propose


def compile_shapes(step, params, cache: KVCache, prev, shapes, empty) -> KVCache:
    """Runs ``step`` once on an all-padding batch (``empty(*shape)``) of each shape, so that no
    request pays for a compilation; returns the (donated, unchanged) cache."""
    tokens = None
    for shape in shapes:
        cache, tokens = step(params, cache, empty(*shape), prev)
    if tokens is not None:
        jax.block_until_ready(tokens)
    return cache
