"""A server whose engine dies exits non-zero (issue 46): it does not stay up answering 503.

A subprocess serves an engine whose device step raises (``Engine.set_device_step``) with
``paged.server.cli.run_server``, the function ``python -m paged.server`` serves with; the first
completion makes the engine loop fail, and the process must end with status 1 within seconds,
the error in its log.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_utils import free_port

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys
from paged import Engine, EngineConfig
from paged.server.app import build_app
from paged.server.cli import run_server

def broken_step(*args):
    raise RuntimeError("device step failed (test)")

engine = Engine(EngineConfig(model="tiny", max_model_len=64, max_num_seqs=2,
                             max_num_batched_tokens=64, attention_impl="xla"))
engine.set_device_step(broken_step)
run_server(build_app(engine), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def test_a_fatal_engine_error_ends_the_server_with_status_1(tmp_path):
    port = free_port()
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(port)], cwd=ROOT,
                                stdout=err, stderr=err)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        try:
            r = httpx.post(base + "/v1/completions", timeout=30,
                           json={"model": "tiny", "prompt": "hello", "max_tokens": 4})
            assert r.status_code == 500 and "device step failed" in r.text, r.text
        except httpx.TransportError:
            pass  # the server may already be gone
        t0 = time.monotonic()
        try:
            code = proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server still runs after its engine failed:\n"
                        f"{log.read_text()[-3000:]}")
        text = log.read_text()
        assert code == 1, text[-3000:]
        assert time.monotonic() - t0 < 10
        assert "device step failed (test)" in text and "exiting with status 1" in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
