"""`experiments.router_events` (smoke variant): prefix-aware routing on the replicas' KV events
(ZeroMQ) hits at least 95 % of what the same routing asking the caches directly hits, its view
equals the routed replica's cache at routing time, and both beat least-loaded routing."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("zmq")

from experiments import router_events  # noqa: E402
from experiments.configs import router_events as config  # noqa: E402


@pytest.mark.slow  # about 12 s: four fresh engines per arm; test_router_kv_events covers the views
def test_routing_on_events_matches_routing_on_the_caches(tmp_path):
    c = config.get_config("smoke")
    c.output_dir = str(tmp_path)
    router_events.main(c, router_events.check(c))
    d = json.loads((tmp_path / "router_events.json").read_text())
    by = {r["arm"]: r for r in d["rows"]}
    assert d["events_over_direct"] >= 0.95
    assert by["events"]["view_exact_at_routing"] >= 0.95
    assert by["events"]["event_batches_lost"] == 0
    assert by["direct"]["prefix_hit_rate"] >= by["least_loaded"]["prefix_hit_rate"]
