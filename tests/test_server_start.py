"""``python -m paged.server`` as a new user starts it: default flags, a subprocess on 127.0.0.1.

One server for the module (started with ``PAGED_API_KEY`` set): its start is timed until
``/health`` answers 200 (with warmup: progress lines to N/N, 503 with ``Retry-After`` meanwhile),
then the API key is checked with the official client, and the last test ends it with SIGTERM.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key-123"
START_BOUND_S = 120  # the default start takes ~20 s on 2 idle cores; generous for a loaded machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "stderr.txt"
    env = {**os.environ, "PAGED_API_KEY": KEY}
    t0 = time.monotonic()
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "paged.server", "--model", "tiny",
                                 "--port", str(port)], cwd=ROOT, env=env, stdout=err, stderr=err)
    base = f"http://127.0.0.1:{port}"
    seen, warming = [], None
    try:
        while time.monotonic() - t0 < START_BOUND_S:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                r = httpx.get(base + "/health", timeout=5)
            except httpx.TransportError:
                time.sleep(0.1)
                continue
            seen.append(r.status_code)
            if r.status_code == 200:
                break
            if warming is None:  # while compiling: /v1/* is refused the same way
                warming = (r, httpx.get(base + "/v1/models", timeout=5,
                                        headers={"Authorization": f"Bearer {KEY}"}))
            time.sleep(0.1)
        elapsed = time.monotonic() - t0
        yield {"proc": proc, "base": base, "log": log, "elapsed": elapsed, "seen": seen,
               "warming": warming}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_default_start_prints_progress_and_is_ready_within_the_bound(started):
    log = started["log"].read_text()
    assert started["seen"] and started["seen"][-1] == 200, (started["seen"], log[-3000:])
    print(f"default server start: /health 200 after {started['elapsed']:.1f} s")
    assert started["elapsed"] < START_BOUND_S
    m = re.findall(r"warmup (\d+)/(\d+) step shapes, ([\d.]+) s", log)
    assert m and m[-1][0] == m[-1][1], log[-3000:]  # progress to N/N, with elapsed time
    assert [int(a) for a, _, _ in m] == list(range(1, int(m[-1][1]) + 1))
    assert "ready: warmup compiled" in log
    # While compiling: 503, Retry-After, OpenAI's error shape (when the poll caught it).
    if started["warming"] is not None:
        for r in started["warming"]:
            assert r.status_code == 503 and int(r.headers["retry-after"]) > 0
            assert r.json()["error"]["code"] == "warming_up"


def test_api_key_is_required_on_v1_only(started):
    base = started["base"]
    good = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
    r = good.completions.create(model="tiny", prompt="def main():", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user",
                                                                      "content": "hi"}]})
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.get(base + "/metrics").status_code == 200


def test_unknown_route_and_method_answer_in_openai_shape(started):
    base, auth = started["base"], {"Authorization": f"Bearer {KEY}"}
    for method, path, status in (("GET", "/nope", 404), ("GET", "/v1/nope", 404),
                                 ("GET", "/v1/completions", 405)):
        r = httpx.request(method, base + path, headers=auth)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and path in err["message"]


def test_sigterm_ends_streams_with_a_final_event_and_exits_0(started):
    proc, base = started["proc"], started["base"]
    body = {"model": "tiny", "prompt": "def main():", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    events = []
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            events.append(line[5:].strip())
            if len(events) == 1:
                proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, started["log"].read_text()[-3000:]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["code"] == "shutting_down", events[-3:]
    assert "shut down on SIGTERM" in started["log"].read_text()
    with pytest.raises(httpx.TransportError):  # no longer accepting
        httpx.get(base + "/health", timeout=2)
