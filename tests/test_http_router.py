"""`paged.router`: the prefix-aware HTTP router in front of two `paged.server` instances.

Two servers (bundled tiny model, the same small engine config as tests/test_server.py; the second
engine reuses the first one's compiled steps) and the routers run in-process: uvicorn in threads
on 127.0.0.1 at free ports, stopped at the end. One more router runs as a subprocess through the
command line. Greedy outputs through a router are compared with the same requests sent to a
server directly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

openai = pytest.importorskip("openai")

from paged import Engine, EngineConfig  # noqa: E402
from paged.fleet.routing import Router  # noqa: E402
from paged.router.app import BACKEND_HEADER, RouterSettings  # noqa: E402
from paged.router.app import build_app as build_router  # noqa: E402
from paged.router.backends import Backend, PrefixTree, parse_load, prompt_key  # noqa: E402
from paged.server.app import ServerSettings  # noqa: E402
from paged.server.app import build_app as build_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = EngineConfig(model="tiny", block_size=16, max_num_seqs=16, max_num_batched_tokens=64,
                      max_model_len=128, attention_impl="xla", min_token_bucket=64,
                      min_seq_bucket=16)
PROMPTS = ["def main():", "import os", "class Foo:", "for i in range(10):"]
SHARED = "Once upon a time, in a land of paged caches and radix trees, there "  # 68 characters
MAX_TOKENS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(app):
    """Runs ``app`` with uvicorn in a thread; returns ``(base URL, stop)``."""
    import uvicorn

    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)

    def stop():
        srv.should_exit = True
        thread.join(15)

    return f"http://127.0.0.1:{port}", stop


@pytest.fixture(scope="module")
def fleet():
    stops = []
    try:
        backends = []
        for _ in range(2):
            app = build_server(Engine(CONFIG), ServerSettings(served_model_name="tiny"))
            base, stop = _serve(app)
            backends.append(base)
            stops.append(stop)
        routers = {}
        for policy in ("prefix_aware", "round_robin"):
            app = build_router(backends, RouterSettings(policy=policy, metrics_interval_s=0.2))
            base, stop = _serve(app)
            routers[policy] = {"base": base, "app": app,
                               "client": openai.OpenAI(base_url=base + "/v1", api_key="x",
                                                       max_retries=0)}
            stops.append(stop)
        direct = openai.OpenAI(base_url=backends[0] + "/v1", api_key="x", max_retries=0)
        yield {"backends": backends, "routers": routers, "direct": direct}
    finally:
        for stop in reversed(stops):
            stop()


def _complete(base: str, prompt, **kw) -> tuple[str, str]:
    """``(text, backend)`` of a greedy completion through ``base``."""
    r = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": prompt,
                                                   "max_tokens": MAX_TOKENS, "temperature": 0,
                                                   **kw}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.headers.get(BACKEND_HEADER)


def _metric(base: str, name: str, labels: str = "") -> float:
    text = httpx.get(base + "/metrics").text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not in /metrics of {base}"
    return float(m.group(1))


def _wait_idle(base: str, backends: list[str], timeout: float = 10.0) -> None:
    """Until the router's scraped load shows every backend idle (scrapes lag by one interval, so
    requests sent straight to a backend can still count against it for a moment)."""
    names = ("paged_router:backend_num_requests_running", "paged_router:backend_num_requests_waiting")
    deadline = time.monotonic() + timeout
    def busy() -> bool:  # a figure not scraped yet counts as busy
        text = httpx.get(base + "/metrics").text
        for n in names:
            for u in backends:
                m = re.search(rf'^{re.escape(n)}{{backend="{re.escape(u)}"}} (\S+)$', text, re.M)
                if m is None or float(m.group(1)):
                    return True
        return False

    while busy():
        assert time.monotonic() < deadline, "backends never looked idle to the router"
        time.sleep(0.05)


# --- units: the routing key, the prefix tree, a backend as a replica ---------------------------
def test_prefix_tree_match_split_and_lru_eviction():
    t = PrefixTree(max_chars=100)
    assert t.match("abc") == 0
    t.insert("hello world")
    t.insert("hello there")  # splits the edge after "hello "
    assert (t.match("hello world!"), t.match("hello th"), t.match("help"), t.match("x")) == (
        11, 8, 3, 0)
    assert len(t) == len("hello world") + len("there")
    t.insert("a" * 60)  # 11 + 5 + 60 = 76 <= 100
    t.insert("hello world, again")
    t.insert("b" * 40)  # over 100: least recently used leaves go ("there" first, then "a"*60)
    assert len(t) <= 90
    assert t.match("b" * 40) == 40 and t.match("hello world, again") == 18
    assert t.match("hello there") == 6 and t.match("a" * 60) == 0
    with pytest.raises(ValueError, match="max_chars"):
        PrefixTree(0)


def test_prompt_key_shapes():
    assert prompt_key({"prompt": "abc"}, "completion") == "abc"
    assert prompt_key({"prompt": ["abc", "def"]}, "completion") == "abc"
    ids = prompt_key({"prompt": [1, 2, 3]}, "completion")
    assert len(ids) == 4 and ids.startswith("\x01") and prompt_key(
        {"prompt": [[1, 2, 3]]}, "completion") == ids
    assert prompt_key({"prompt": [1, True]}, "completion") == ""
    chat = prompt_key({"messages": [{"role": "system", "content": "sys"},
                                    {"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
                      "chat")
    assert chat == "<|system|>\nsys\n<|user|>\nhi\n"
    salted = prompt_key({"prompt": "abc", "cache_salt": "s1"}, "completion")
    assert salted.endswith("abc") and salted != "abc"
    assert prompt_key({"prompt": None}, "completion") == prompt_key({}, "chat") == ""


def test_backend_is_a_replica_for_the_policy():
    a, b = Backend("http://a:1/"), Backend("http://b:1", prefix_granularity=16)
    assert a.url == "http://a:1"
    key = SHARED + "x"
    a.routed(key)
    a.finished()
    # The hit is counted in whole multiples of the granularity; a few characters are no hit.
    assert a.cached_prefix_tokens(SHARED + "y") == len(SHARED) // 16 * 16
    assert a.cached_prefix_tokens("Once upon") == 0 and b.cached_prefix_tokens(key) == 0
    router = Router("prefix_aware", load_threshold=2)
    assert router.route(SHARED + "z", [a, b]) == 0 and router.num_routed == {"prefix": 1}
    # Load: the larger of this router's in-flight requests and the scraped waiting + running.
    b.scraped((1, 2))
    assert (b.num_waiting, b.num_running) == (1, 2)
    for _ in range(5):
        b.routed("")
    assert (b.num_waiting + b.num_running, b.load) == (5, 5)
    a.scraped((0, 6))  # the prefix winner is 1 request busier than b: kept (threshold 2)
    assert router.route(SHARED + "z", [a, b]) == 0
    a.scraped((0, 8))  # 3 busier: overloaded, the least-loaded one wins
    assert router.route(SHARED + "z", [a, b]) == 1 and router.num_routed["overloaded"] == 1
    a.failed("refused")
    assert not a.up and a.cached_prefix_tokens(key) == 0  # a lost backend's tree starts over
    text = ("# HELP paged:num_requests_running x\npaged:num_requests_running 3.0\n"
            "paged:num_requests_waiting 4.0\n")
    assert parse_load(text) == (4, 3) and parse_load("nothing") is None


# --- over HTTP ----------------------------------------------------------------------------------
def test_health_models_and_metrics(fleet):
    r = fleet["routers"]["prefix_aware"]
    h = httpx.get(r["base"] + "/health")
    assert h.status_code == 200 and [b["url"] for b in h.json()["backends"]] == fleet["backends"]
    assert all(b["up"] for b in h.json()["backends"])
    assert [m.id for m in r["client"].models.list().data] == ["tiny"]
    time.sleep(0.3)  # a scrape
    for url in fleet["backends"]:
        lab = f'{{backend="{url}"}}'
        assert _metric(r["base"], "paged_router:backend_up", lab) == 1.0
        assert _metric(r["base"], "paged_router:backend_num_requests_running", lab) == 0.0


def test_greedy_through_the_router_equals_a_server_directly(fleet):
    direct = fleet["direct"]
    want = {p: direct.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS,
                                         temperature=0).choices[0].text for p in PROMPTS}
    for policy, r in fleet["routers"].items():
        _wait_idle(r["base"], fleet["backends"])  # the direct requests' load has been scraped
        used = set()
        for p in PROMPTS:
            text, backend = _complete(r["base"], p)
            assert text == want[p], (policy, p)
            used.add(backend)
        # Cold prompts (round robin: every prompt) spread over both backends.
        assert used == set(fleet["backends"]), policy
        # Streaming through the router: the same text, chunk by chunk, usage and [DONE] kept.
        client = r["client"]
        for p in PROMPTS[:2]:
            chunks = list(client.completions.create(
                model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                stream_options={"include_usage": True}))
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
            assert "".join(c.choices[0].text for c in chunks if c.choices) == want[p]
    # Chat, streaming and not, through the router equals the server's.
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    full = direct.chat.completions.create(model="tiny", messages=msgs, max_tokens=MAX_TOKENS,
                                          temperature=0).choices[0].message.content
    client = fleet["routers"]["prefix_aware"]["client"]
    got = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=MAX_TOKENS,
                                         temperature=0)
    assert got.object == "chat.completion" and got.choices[0].message.content == full
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs,
                                                 max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full


def test_shared_prefix_sticks_to_one_backend_under_prefix_aware(fleet):
    base = fleet["routers"]["prefix_aware"]["base"]
    prompts = [SHARED + f"{name} lived." for name in ("Ada", "Bob", "Cy", "Di", "Ed", "Flo")]
    first = _complete(base, prompts[0])[1]
    hits = _metric(first, "paged:prefix_cache_hit_tokens_total")
    assert {_complete(base, p)[1] for p in prompts[1:]} == {first}
    # The backend's own prefix cache served the shared blocks (68 characters + BOS: 4 blocks).
    assert _metric(first, "paged:prefix_cache_hit_tokens_total") >= hits + 5 * 64
    # A burst of concurrent requests with another shared prefix: all inserted at routing time,
    # so all land on one backend too (its load stays within the threshold).
    other = "A different preamble that no backend has seen before this point, ok. "
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: _complete(base, other + str(i)), range(8)))
    assert len({b for _, b in got}) == 1
    assert _metric(base, "paged_router:routed_total", '{decision="prefix"}') >= 5 + 7


def test_shared_prefix_alternates_under_round_robin(fleet):
    base = fleet["routers"]["round_robin"]["base"]
    seq = [_complete(base, SHARED + f"{i} was here.")[1] for i in range(4)]
    assert seq[0] != seq[1] and seq[::2] == [seq[0]] * 2 and seq[1::2] == [seq[1]] * 2


def test_backend_errors_pass_through(fleet):
    base = fleet["routers"]["prefix_aware"]["base"]
    r = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "x",
                                                   "temperature": -0.5})
    assert r.status_code == 400 and r.headers[BACKEND_HEADER] in fleet["backends"]
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "temperature"
    r = httpx.post(base + "/v1/completions", content=b'{"prompt": "x"',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(base + "/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        fleet["routers"]["prefix_aware"]["client"].chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=-1)


def test_client_hanging_up_aborts_on_the_backend(fleet):
    base = fleet["routers"]["prefix_aware"]["base"]
    body = {"model": "tiny", "prompt": "def main():", "max_tokens": 100, "temperature": 0,
            "ignore_eos": True, "stream": True}
    before = {u: _metric(u, "paged:request_aborted_total") for u in fleet["backends"]}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        backend = resp.headers[BACKEND_HEADER]
        for line in resp.iter_lines():
            if line.startswith("data:"):
                break  # one chunk, then hang up
    deadline = time.monotonic() + 10
    while _metric(backend, "paged:request_aborted_total") < before[backend] + 1:
        assert time.monotonic() < deadline, "the backend did not abort the request"
        time.sleep(0.05)
    lab = f'{{backend="{backend}"}}'
    deadline = time.monotonic() + 5
    while _metric(base, "paged_router:backend_in_flight", lab) != 0:
        assert time.monotonic() < deadline, "the router still counts the stream in flight"
        time.sleep(0.05)


def test_dead_backend(fleet):
    dead = f"http://127.0.0.1:{_free_port()}"
    # Only a dead backend: 502 in OpenAI's error shape, /health 503.
    base, stop = _serve(build_router([dead], RouterSettings(metrics_interval_s=0.2)))
    try:
        r = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == "backend_unavailable" and dead in err["message"]
        assert httpx.get(base + "/health").status_code == 503
    finally:
        stop()
    # A dead backend beside a live one: every request is served by the live one (a refused
    # connection is retried elsewhere before anything was sent), the dead one is marked down.
    live = fleet["backends"][0]
    base, stop = _serve(build_router([dead, live], RouterSettings(policy="round_robin",
                                                                  metrics_interval_s=0.2)))
    try:
        assert {_complete(base, p)[1] for p in PROMPTS} == {live}
        assert _metric(base, "paged_router:backend_up", f'{{backend="{dead}"}}') == 0.0
        health = httpx.get(base + "/health")
        assert health.status_code == 200 and not health.json()["backends"][0]["up"]
    finally:
        stop()


def test_cli_runs_the_router(fleet):
    port = _free_port()
    a, b = fleet["backends"]
    proc = subprocess.Popen([sys.executable, "-m", "paged.router", "--backend", a,
                             "--backend", b, "--port", str(port), "--metrics-interval", "0.2"],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "router did not start"
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        want = fleet["direct"].completions.create(model="tiny", prompt=PROMPTS[0],
                                                  max_tokens=MAX_TOKENS, temperature=0)
        assert _complete(base, PROMPTS[0])[0] == want.choices[0].text
    finally:
        proc.terminate()
        proc.wait(15)


def test_cli_bad_args_are_one_line():
    cases = [([], "--backend"),
             (["--backend", "localhost:8000"], "http://"),
             (["--backend", "http://a:1", "--policy", "fastest"], "--policy"),
             (["--backend", "http://a:1", "--load_threshold", "-1"], "load_threshold"),
             (["--backend", "http://a:1", "--backend", "http://a:1/"], "twice"),
             (["--backend", "http://a:1", "--metrics-interval", "0"], "metrics_interval"),
             (["--backend", "http://a:1", "--bogus", "1"], "--bogus")]
    procs = [(subprocess.Popen([sys.executable, "-m", "paged.router", *flags], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), word)
             for flags, word in cases]
    for proc, word in procs:
        _, err = proc.communicate(timeout=60)
        lines = err.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, err
        assert lines[0].startswith("paged.router: ") and word in lines[0], lines


def test_router_settings_checks():
    with pytest.raises(ValueError, match="policy"):
        RouterSettings(policy="fastest")
    with pytest.raises(ValueError, match="load_threshold"):
        RouterSettings(load_threshold=-1)
    with pytest.raises(ValueError, match="metrics_interval_s"):
        RouterSettings(metrics_interval_s=0)
    with pytest.raises(ValueError, match="backend"):
        build_router([])
    assert json.loads(json.dumps(RouterSettings().__dict__))["policy"] == "prefix_aware"


def _fake_backend(name: str):
    """A stand-in backend (FastAPI, no engine) whose load and timing the test sets: ``/metrics``
    reports ``state["waiting"]``; the prompt ``"hold"`` waits for ``state["release"]``; ``"die"``
    streams one event and then drops the connection."""
    state = {"waiting": 0, "release": threading.Event()}
    app = FastAPI()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(f"paged:num_requests_waiting {state['waiting']}.0\n"
                                 f"paged:num_requests_running {state.get('running', 0)}.0\n")

    @app.post("/v1/completions")
    async def completions(request: Request):
        prompt = json.loads(await request.body())["prompt"]
        if prompt == "die":
            async def events():
                yield b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
                raise RuntimeError("backend crashed (on purpose)")

            return StreamingResponse(events(), media_type="text/event-stream")
        while prompt == "hold" and not state["release"].is_set():
            await asyncio.sleep(0.01)
        return {"choices": [{"index": 0, "text": name, "finish_reason": "stop"}]}

    return app, state


def test_least_loaded_reads_in_flight_and_scraped_load():
    fakes, stops = [], []
    try:
        for name in ("f1", "f2"):
            app, state = _fake_backend(name)
            base, stop = _serve(app)
            fakes.append((base, state))
            stops.append(stop)
        (b1, s1), (b2, s2) = fakes
        base, stop = _serve(build_router([b1, b2], RouterSettings(policy="least_loaded",
                                                                  metrics_interval_s=0.1)))
        stops.append(stop)

        def send(prompt):
            r = httpx.post(base + "/v1/completions", json={"prompt": prompt}, timeout=30)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        # Scraped: f2 reports 5 waiting, so everything goes to f1.
        s2["waiting"] = 5
        time.sleep(0.35)
        assert [send(str(i)) for i in range(4)] == ["f1"] * 4
        s2["waiting"] = 0
        time.sleep(0.35)
        # In flight: a request held open on one backend sends the next ones to the other.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(send, "hold")
            deadline = time.monotonic() + 10
            while not any(b["in_flight"] for b in httpx.get(base + "/health").json()["backends"]):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            busy = next(b["url"] for b in httpx.get(base + "/health").json()["backends"]
                        if b["in_flight"])
            other = "f2" if busy == b1 else "f1"
            assert [send(str(i)) for i in range(3)] == [other] * 3
            # A client that gives up on a whole (non-streaming) response: the router notices
            # within a second and closes the upstream request.
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(base + "/v1/completions", json={"prompt": "hold"}, timeout=0.3)
            deadline = time.monotonic() + 5
            while sum(b["in_flight"] for b in httpx.get(base + "/health").json()["backends"]) > 1:
                assert time.monotonic() < deadline, "the router still waits for a client that left"
                time.sleep(0.05)
            s1["release"].set()
            s2["release"].set()
            assert held.result(10) == ("f1" if busy == b1 else "f2")
        # A backend that dies mid-stream: the stream ends with an error event and [DONE].
        with httpx.stream("POST", base + "/v1/completions", json={"prompt": "die", "stream": True},
                          timeout=30) as resp:
            assert resp.status_code == 200
            events = [line[5:].strip() for line in resp.iter_lines() if line.startswith("data:")]
        assert events[-1] == "[DONE]" and json.loads(events[0])["choices"][0]["text"] == "a"
        assert json.loads(events[-2])["error"]["code"] == "backend_error"
    finally:
        for stop in reversed(stops):
            stop()


def test_health_of_a_backend_that_dies_resets_its_figures_and_says_their_age():
    app, state = _fake_backend("f")
    state["running"], state["waiting"] = 3, 2
    fake, stop_fake = _serve(app)
    base, stop = _serve(build_router([fake], RouterSettings(metrics_interval_s=0.1)))
    try:
        time.sleep(0.3)
        (b,) = httpx.get(base + "/health").json()["backends"]
        assert (b["up"], b["running"], b["waiting"], b["down_for_s"]) == (True, 3, 2, None)
        assert 0 <= b["scraped_age_s"] < 5
        stop_fake()
        deadline = time.monotonic() + 10
        while httpx.get(base + "/health").status_code != 503:
            assert time.monotonic() < deadline, "the router did not notice the backend died"
            time.sleep(0.05)
        time.sleep(0.2)
        (b,) = httpx.get(base + "/health").json()["backends"]
        assert (b["up"], b["running"], b["waiting"]) == (False, 0, 0)
        assert b["down_for_s"] > 0 and b["scraped_age_s"] >= b["down_for_s"]
    finally:
        stop()


def test_metrics_prefix_vllm_names_and_the_router_reads_both():
    from paged.server.metrics import ServerMetrics

    for prefix in ("paged", "vllm"):
        m = ServerMetrics(prefix)
        m.running.set(3)
        m.waiting.set(4)
        text = m.render().decode()
        assert f"{prefix}:num_requests_running 3.0" in text and f"{prefix}:kv_cache_usage_perc" in text
        assert parse_load(text) == (4, 3)
    with pytest.raises(ValueError, match="prefix"):
        ServerMetrics("sglang")
