"""The engine-core wire (`paged.server.wire` -> `paged.server.core_client.RemoteOutput`): every
`RequestOutput` field the server reads survives the msgpack round trip, per-tier cached tokens
included, and only new tokens travel."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("msgpack")

from paged.request.outputs import CompletionOutput, OutputDeltas  # noqa: E402
from paged.server import wire  # noqa: E402
from paged.server.core_client import RemoteOutput  # noqa: E402


def _out(ids, finished, cached=12, host=8, lps=None, plps=None):
    log = [99, *ids]  # one prompt token, then the generated ones: a sequence's token list
    sample = CompletionOutput(0, log, 1, len(log), "length" if finished else None, str, lps)
    return types.SimpleNamespace(
        request_id="r", outputs=[sample], finished=finished,
        finish_reason="length" if finished else None, finish_time=2.0 if finished else None,
        arrival_time=0.5, first_token_time=1.0, num_cached_tokens=cached,
        num_preemptions=1, num_host_cached_tokens=host, prompt_logprobs=plps)


def test_round_trip_carries_cached_tokens_per_tier():
    enc, remote = wire.DeltaEncoder(), RemoteOutput("r", [1, 2, 3])
    plps = [None, {2: -0.5, 7: -0.25}, {3: -1.0}]
    assert enc.encode(_out([], False, plps=plps))[-1] is None  # not before the first token
    first = enc.encode(_out([5, 6], False, plps=plps))
    remote.update(wire.unpack(wire.pack(first)))
    assert remote.prompt_logprobs == plps  # int keys survive msgpack
    snap = remote.snapshot()
    msg = enc.encode(_out([5, 6, 7], True, plps=plps))
    assert msg[-2][0][1] == [7] and msg[-1] is None  # only the new token; the prompt's once
    remote.update(wire.unpack(wire.pack(msg)))
    assert remote.token_ids == [5, 6, 7] and remote.finished and remote.finish_time == 2.0
    assert (remote.num_cached_tokens, remote.num_host_cached_tokens) == (12, 8)
    assert remote.num_preemptions == 1 and remote.first_token_time == 1.0
    assert (snap.num_host_cached_tokens, snap.token_ids) == (8, [5, 6])  # a snapshot keeps it


def test_deltas_copy_only_new_tokens_and_snapshots_hold():
    """`OutputDeltas` hands each consumer only the tokens (and log-probabilities) it has not
    seen; a finished request is forgotten; the core client's snapshots keep their own count
    while the shared lists grow."""
    deltas = OutputDeltas()
    lp = [{5: -0.1}, {6: -0.2}, {7: -0.3}]
    (o, ids, lps), = deltas.take(_out([5, 6], False, lps=lp[:2]))
    assert (ids, lps) == ([5, 6], lp[:2]) and o.num_token_ids == 2
    assert deltas.take(_out([5, 6], False, lps=lp[:2]))[0][1:] == ([], [])  # nothing new
    assert deltas.take(_out([5, 6, 7], True, lps=lp), logprobs=False)[0][1:] == ([7], None)
    assert deltas.take(_out([5, 6, 7], True, lps=lp))[0][1] == [5, 6, 7]  # forgotten: all again
    enc, remote = wire.DeltaEncoder(), RemoteOutput("r", [1])
    remote.update(wire.unpack(wire.pack(enc.encode(_out([5], False, lps=lp[:1])))))
    snap = remote.snapshot()
    remote.update(wire.unpack(wire.pack(enc.encode(_out([5, 6, 7], True, lps=lp)))))
    assert (snap.token_ids, snap.outputs[0].logprobs) == ([5], lp[:1])
    assert (remote.token_ids, remote.outputs[0].logprobs) == ([5, 6, 7], lp)
    assert remote.outputs[0].token_ids_from(1) == [6, 7] and snap.outputs[0].token_ids_from(0) == [5]
