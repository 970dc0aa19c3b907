"""The engine-core process's messages, as msgpack.

Why msgpack over ZeroMQ: a step's outputs are small lists of ints, floats and short strings;
msgpack packs them without a schema in a few microseconds (C extension), keeps ints as ints, and
is what vLLM V1 uses between its API server and its EngineCore for the same reason. ZeroMQ gives
message framing, a local ``ipc://`` transport and non-blocking polling without a home-made
protocol. Only the start-up hand-over (the model's config and tokenizer, once) is pickled.

Commands (server -> core), one msgpack list each:

- ``["add", request_id, token_ids, params, timeout_s]`` with ``params`` the non-default fields
  of `SamplingParams` as a dict;
- ``["abort", [request_id, ...]]``;
- ``["warmup"]`` (answered by ``["warm", compilations]``) and ``["stop"]``.

Step messages (core -> server): ``["step", outputs, stats]`` after every step, with ``stats`` the
`STAT_KEYS` values of ``kv_stats()`` and one entry per `RequestOutput`:
``[request_id, finished, finish_reason, finish_time, arrival_time, first_token_time,
num_cached_tokens, num_preemptions, num_host_cached_tokens, samples, prompt_logprobs]``
(``prompt_logprobs`` once, in the first message where a sample has a token, when the request
asked for them; else None), each sample
``[index, new token ids, finish_reason, new logprobs or None, stop_reason, text or None]``
(only the tokens and log-probabilities that are new since the previous message: the client keeps
the rest; ``text`` only when a stop string ended the sample). ``["rejected", request_id, message]``
when the core refuses an add the server's checks let through, ``["error", message]`` when the
engine raised (the core then exits).
"""

from __future__ import annotations

import dataclasses

import msgpack

from paged.request.outputs import OutputDeltas
from paged.request.sampling import SamplingParams

STAT_KEYS = ("num_running", "num_waiting", "num_blocks", "num_used_blocks",
             "prefix_cache_hit_tokens", "num_preemptions")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes):
    # Log-probabilities are dicts keyed by token id: int keys must be allowed.
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def params_to_wire(params: SamplingParams) -> dict:
    """The fields that differ from the defaults (tuples become lists)."""
    out = {}
    for name, default in _DEFAULTS.items():
        value = getattr(params, name)
        if value != default:
            out[name] = list(value) if isinstance(value, tuple) else value
    return out


def params_from_wire(fields: dict) -> SamplingParams:
    fields = {k: tuple(v) if isinstance(_DEFAULTS[k], tuple) else v for k, v in fields.items()}
    return SamplingParams(**fields)


class DeltaEncoder:
    """The core's side: encodes `RequestOutput`s as deltas against what it already sent."""

    def __init__(self):
        self._deltas = OutputDeltas()
        self._prompt_sent: set[str] = set()  # requests whose prompt_logprobs went out

    def encode(self, out) -> list:
        samples = [[o.index, ids, o.finish_reason, lps, o.stop_reason,
                    o.text if isinstance(o.stop_reason, str) else None]
                   for o, ids, lps in self._deltas.take(out)]
        plps = None
        rid = out.request_id
        if rid not in self._prompt_sent and any(s[1] for s in samples):
            plps = getattr(out, "prompt_logprobs", None)
            if plps is not None:
                self._prompt_sent.add(rid)
        if out.finished:
            self._prompt_sent.discard(rid)
        return [rid, out.finished, out.finish_reason, out.finish_time, out.arrival_time,
                out.first_token_time, out.num_cached_tokens, out.num_preemptions,
                out.num_host_cached_tokens, samples, plps]

    def forget(self, request_id: str) -> None:
        self._deltas.forget(request_id)
        self._prompt_sent.discard(request_id)
