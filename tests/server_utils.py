"""What the in-process server tests share: the small engine config, prompts, a free port, an
app served by uvicorn in a thread on 127.0.0.1, and reading its Prometheus metrics."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time

import httpx

from paged import EngineConfig

# One step shape per variant, so the engine compiles once (module fixtures share it).
CONFIG = EngineConfig(model="tiny", block_size=16, max_num_seqs=16, max_num_batched_tokens=64,
                      max_model_len=128, attention_impl="xla", min_token_bucket=64,
                      min_seq_bucket=16)
PROMPTS = ["def main():", "import os", "class Foo:", "for i in range(10):"]
MAX_TOKENS = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app, start_timeout_s: float = 30.0):
    """Serves ``app`` with uvicorn on 127.0.0.1 and a free port; yields the base URL; stops it."""
    import uvicorn

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(15)


def metric(base: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(base + "/metrics").text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def wait_idle(base: str, timeout: float = 20.0) -> None:
    """Waits until nothing runs, waits or holds a KV block (else fails with the metrics)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (metric(base, "paged:num_requests_running") == 0
                and metric(base, "paged:kv_cache_usage_perc") == 0
                and metric(base, "paged:num_requests_waiting") == 0):
            return
        time.sleep(0.05)
    raise AssertionError(httpx.get(base + "/metrics").text[:3000])
