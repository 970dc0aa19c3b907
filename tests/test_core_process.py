"""The engine core in its own process (`paged.server.core_client` / `core_process`), through the
HTTP server and the official ``openai`` client: the same outputs as the engine in process, aborts,
metrics, checks before anything reaches the core, and a core that dies.

The server runs in-process (uvicorn in a thread on 127.0.0.1, a free port); its engine is an
`EngineCoreClient` whose core is a spawned child process with the same small config as
``tests/test_server.py``.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("zmq")

from engine_utils import host_devices_flags  # noqa: E402
from server_utils import CONFIG, MAX_TOKENS, PROMPTS, serve_in_thread  # noqa: E402
from server_utils import metric as _metric  # noqa: E402
from server_utils import wait_idle as _wait_idle  # noqa: E402

from paged import Engine, EngineConfig, SamplingParams  # noqa: E402
from paged.server.app import ServerSettings, build_app  # noqa: E402
from paged.server.core_client import EngineCoreClient  # noqa: E402


@pytest.fixture(scope="module")
def server():
    engine = Engine(CONFIG)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    offline = {p: o.text for p, o in zip(PROMPTS, engine.generate(PROMPTS, greedy))}
    n2 = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=MAX_TOKENS, n=2,
                                                      temperature=0.8, seed=7))[0]
    stop = offline[PROMPTS[0]][3:5]
    stopped = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                           stop=stop))[0].text
    del engine
    client = EngineCoreClient(CONFIG)
    app = build_app(client, ServerSettings(served_model_name="tiny"))
    with serve_in_thread(app) as base:
        yield {"base": base, "core": client, "offline": offline, "stop": (stop, stopped),
               "n2": [o.text for o in n2.outputs],
               "client": openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)}
    client.close()  # already closed by the app's shutdown: a second close is a no-op


def test_outputs_equal_the_engine_in_process(server):
    client, offline = server["client"], server["offline"]
    for p in PROMPTS[:2]:
        r = client.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS,
                                      temperature=0, logprobs=2)
        assert r.choices[0].text == offline[p]
        assert len(r.choices[0].logprobs.token_logprobs) == r.usage.completion_tokens
        assert r.usage.prompt_tokens == len(p.encode()) + 1

    def one(i):
        p = PROMPTS[i % len(PROMPTS)]
        chunks = list(client.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True))
        return p, "".join(c.choices[0].text for c in chunks if c.choices)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for p, text in pool.map(one, range(16)):
            assert text == offline[p]
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, n=2,
                                  temperature=0.8, seed=7)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == server["n2"]
    stop, stopped = server["stop"]
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                  temperature=0, stop=stop)
    assert r.choices[0].text == stopped and r.choices[0].finish_reason == "stop"
    _wait_idle(server["base"])
    assert _metric(server["base"], "paged:generation_tokens_total") > 0


def test_checks_run_before_the_core_and_disconnect_aborts(server):
    base = server["base"]
    r = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "x" * 200})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    with pytest.raises(ValueError, match="max_model_len"):
        server["core"].add_request("direct", "x" * 200)  # the engine's own checks, here
    assert not server["core"].has_request("direct")
    aborted = _metric(base, "paged:request_aborted_total")
    body = {"model": "tiny", "prompt": "def main():", "max_tokens": 100, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data:"):
                break  # one chunk, then hang up
    _wait_idle(base)
    assert _metric(base, "paged:request_aborted_total") == aborted + 1


def test_a_dead_core_is_an_error_not_a_hang(server):
    """Runs last: the core is killed; the request in flight and later ones get errors."""
    base, core = server["base"], server["core"]
    body = {"model": "tiny", "prompt": "def main():", "max_tokens": 100, "temperature": 0,
            "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, base + "/v1/completions", json=body, timeout=30)
        time.sleep(0.3)
        os.kill(core.pid, signal.SIGKILL)
        r = pending.result()
    assert r.status_code in (500, 503) and r.json()["error"]["type"] == "server_error"
    deadline = time.monotonic() + 10
    while httpx.get(base + "/health").status_code == 200:
        assert time.monotonic() < deadline, "/health still 200 after the core died"
        time.sleep(0.1)
    r = httpx.post(base + "/v1/completions", json={**body, "max_tokens": 2})
    assert r.status_code == 503 and "engine" in r.json()["error"]["message"]


def test_a_core_that_cannot_build_its_engine_says_why(tmp_path):
    with pytest.raises(RuntimeError, match="could not build the engine"):
        EngineCoreClient(EngineConfig(model=str(tmp_path)))  # a directory with no checkpoint


def test_data_parallel_cores_route_and_match_one_engine(server, monkeypatch):
    """D = 2 cores, one process each (each child sees two host devices and takes its own);
    the prefix-aware router sends a repeated prompt back to the core that served it."""
    from paged.server.core_replicas import CoreReplicas

    monkeypatch.setenv("XLA_FLAGS", host_devices_flags(2))
    import dataclasses

    cores = CoreReplicas(dataclasses.replace(CONFIG, data_parallel_size=2))
    try:
        greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        with pytest.raises(ValueError, match="max_model_len"):
            cores.add_request("long", "x" * 200, greedy)
        assert not cores.has_request("long") and cores.router.num_routed == {}
        owners = {}
        for i, p in enumerate(PROMPTS):
            cores.add_request(f"r{i}", p, greedy)
            owners[f"r{i}"] = cores.replica_of(f"r{i}")
        assert sorted(set(owners.values())) == [0, 1]  # cold prompts: least loaded, both used
        with pytest.raises(ValueError, match="duplicate"):
            cores.add_request("r0", PROMPTS[0], greedy)
        done = {}
        while cores.has_unfinished_requests() or cores.has_step_in_flight():
            for o in cores.step():
                if o.finished:
                    done[o.request_id] = cores.tokenizer.decode(o.outputs[0].token_ids)
        assert done == {f"r{i}": server["offline"][p] for i, p in enumerate(PROMPTS)}
        stats = cores.kv_stats()
        assert len(stats["replicas"]) == 2 and stats["num_used_blocks"] == 0
        long_prompt = "def main():\n    return 1 + 2 + 3 + 4 + 5"  # more than two blocks
        cores.add_request("a", long_prompt, greedy)
        first = cores.replica_of("a")
        cores.add_request("b", long_prompt + " + 6", greedy)
        assert cores.replica_of("b") == first and cores.router.num_routed.get("prefix") == 1
    finally:
        cores.close()
