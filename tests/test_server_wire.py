"""The engine-core wire (`paged.server.wire` -> `paged.server.core_client.RemoteOutput`): every
`RequestOutput` field the server reads survives the msgpack round trip, per-tier cached tokens
included, and only new tokens travel."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("msgpack")

from paged.server import wire  # noqa: E402
from paged.server.core_client import RemoteOutput  # noqa: E402


def _out(ids, finished, cached=12, host=8):
    sample = types.SimpleNamespace(index=0, token_ids=list(ids), logprobs=None,
                                   finish_reason="length" if finished else None,
                                   stop_reason=None, text="")
    return types.SimpleNamespace(
        request_id="r", outputs=[sample], finished=finished,
        finish_reason="length" if finished else None, finish_time=2.0 if finished else None,
        arrival_time=0.5, first_token_time=1.0, num_cached_tokens=cached,
        num_preemptions=1, num_host_cached_tokens=host)


def test_round_trip_carries_cached_tokens_per_tier():
    enc, remote = wire.DeltaEncoder(), RemoteOutput("r", [1, 2, 3])
    first = enc.encode(_out([5, 6], False))
    remote.update(wire.unpack(wire.pack(first)))
    snap = remote.snapshot()
    msg = enc.encode(_out([5, 6, 7], True))
    assert msg[-1][0][1] == [7]  # only the new token travels
    remote.update(wire.unpack(wire.pack(msg)))
    assert remote.token_ids == [5, 6, 7] and remote.finished and remote.finish_time == 2.0
    assert (remote.num_cached_tokens, remote.num_host_cached_tokens) == (12, 8)
    assert remote.num_preemptions == 1 and remote.first_token_time == 1.0
    assert (snap.num_host_cached_tokens, snap.token_ids) == (8, [5, 6])  # a snapshot keeps it
