"""The checks a request passes before it changes any engine state (``Engine.add_request``)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence as SequenceT

import numpy as np

from paged.request.chat import chat_ids, is_conversation
from paged.request.sampling import SamplingParams
from paged.util import validate

TENANT_MARK = b"|tenant:"  # a tenant's key salt: the model's salt, this mark, the tenant's salt


@functools.lru_cache(maxsize=1 << 16)
def derive_seed(engine_seed: int, request_index: int) -> int:
    """The sampling seed of the ``request_index``-th unseeded request of an engine (kept: a
    ``SeedSequence`` costs ~15 us, and a simulated fleet's replicas share the engine seed, so
    they ask for the same indices)."""
    return int(np.random.SeedSequence([engine_seed, request_index]).generate_state(1)[0] % 2**31)


def check_request(table, request_id, prompt, params, arrival_time, timeout_s,
                   cache_salt) -> tuple:
    """``Engine.add_request``'s checks, with no side effect: returns (request id, token ids,
    params, arrival time, timeout, full cache salt), or raises TypeError / ValueError.

    ``table``: what the checks read: ``has_request(request_id)``, ``config``, ``cache_salt``,
    ``tokenizer`` and ``vocab_size`` (a ``paged.step.host_core.HostCore``, or a data-parallel
    engine's view over its replicas)."""
    request_id = validate.string("request_id", request_id)
    if table.has_request(request_id):
        raise ValueError(f"duplicate request_id={request_id!r}")
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    token_ids = encode(table, prompt)
    max_len = table.config.max_model_len
    if len(token_ids) >= max_len:
        raise ValueError(f"prompt of {len(token_ids)} tokens leaves no room for output: "
                         f"max_model_len={max_len}")
    if params.max_tokens is None:  # vLLM's meaning: what is left of the context
        params = dataclasses.replace(params, max_tokens=max_len - len(token_ids))
    if params.n > table.config.max_num_seqs:
        raise ValueError(f"n={params.n} > max_num_seqs={table.config.max_num_seqs}")
    arrival_time = validate.real("arrival_time", arrival_time, allow_none=True)
    timeout_s = validate.real("timeout_s", timeout_s, minimum=0, exclusive=True,
                              allow_none=True)
    if timeout_s is None:
        timeout_s = table.config.request_timeout_s
    if cache_salt is not None:
        if not isinstance(cache_salt, (str, bytes)):
            raise TypeError(f"cache_salt={cache_salt!r:.80} must be str or bytes, got "
                            f"{type(cache_salt).__name__}")
        if not cache_salt:
            raise ValueError(f"cache_salt={cache_salt!r} must be non-empty (None: no salt)")
        raw = cache_salt.encode() if isinstance(cache_salt, str) else cache_salt
        # The model's salt first, so a tenant's keys never match another model's either.
        cache_salt = table.cache_salt + TENANT_MARK + raw
    return request_id, token_ids, params, arrival_time, timeout_s, cache_salt


def encode(table, prompt) -> list[int]:
    """The prompt's token ids: text encoded with BOS, a conversation (a list of message dicts)
    rendered with the tokenizer's chat template and encoded (`paged.request.chat`), or token ids
    checked (never coerced)."""
    if is_conversation(prompt):
        return validate.token_ids("prompt", chat_ids(table.tokenizer, prompt),
                                  limit=table.vocab_size)
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        return table.tokenizer.encode(prompt)
    if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, SequenceT | np.ndarray):
        raise TypeError(f"prompt must be str or a sequence of token ids, got {type(prompt).__name__}")
    return validate.token_ids("prompt", prompt, limit=table.vocab_size)


def check_prompts(table, prompts, params) -> list[tuple]:
    """``Engine.generate``'s checks, all before any request is added: each prompt and params as
    ``check_request`` checks them (errors name ``prompts[i]``); returns their checked tuples, with
    request ids ``gen<n>-<i>``. A str or one conversation (a list of message dicts) is one
    prompt."""
    if isinstance(prompts, str) or is_conversation(prompts):
        prompts = [prompts]
    if not isinstance(prompts, SequenceT):
        raise TypeError(f"prompts must be a str or a sequence of prompts, got "
                        f"{type(prompts).__name__}")
    params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(params_list) != len(prompts):
        raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts")
    base = f"gen{table.num_requests}-"
    checked = []
    for i, (prompt, p) in enumerate(zip(prompts, params_list)):
        try:
            checked.append(check_request(table, f"{base}{i}", prompt, p, None, None, None))
        except (TypeError, ValueError) as e:
            raise type(e)(f"prompts[{i}]: {e}") from None
    return checked
