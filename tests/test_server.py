"""`paged.server`: the OpenAI-compatible server, driven by the official ``openai`` client.

One server (bundled tiny model, a small engine with a single step shape so it compiles once) runs
in-process for the whole module: uvicorn in a thread on 127.0.0.1 with a free port, stopped at the
end. Greedy outputs are compared with `Engine.generate` on the same engine, run before the server
takes it over.
"""

from __future__ import annotations

import ast
import concurrent.futures
import json
import re
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

from cli_runner import ForkRunner  # noqa: E402
from server_utils import CONFIG, MAX_TOKENS, PROMPTS, serve_in_thread  # noqa: E402
from server_utils import metric as _metric  # noqa: E402
from server_utils import wait_idle as _wait_idle  # noqa: E402

from paged import Engine, SamplingParams  # noqa: E402
from paged.server.app import ServerSettings, build_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server():
    engine = Engine(CONFIG)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    offline = {p: o.text for p, o in zip(PROMPTS, engine.generate(PROMPTS, greedy))}
    offline_n2 = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=MAX_TOKENS, n=2,
                                                              temperature=0.8, seed=7))[0]
    # Stop strings and max_tokens=None in the library, compared with the server's below.
    stop = offline[PROMPTS[0]][3:5]
    lib = {kw: engine.generate([PROMPTS[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                            stop=stop, **dict([kw])))[0].outputs[0]
           for kw in (("include_stop_str_in_output", False), ("include_stop_str_in_output", True))}
    tid = lib["include_stop_str_in_output", False].token_ids[1]
    lib["tok"] = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                              stop_token_ids=[tid]))[0].outputs[0]
    lib["none"] = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=None,
                                                               temperature=0))[0].outputs[0]
    lib_prompt = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0,
                                                              prompt_logprobs=2))[0]
    # The README's library example: its prompts show text, not whitespace.
    readme = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    prompts = ast.literal_eval(re.search(r"generate\((\[.*?\])", readme, re.S).group(1))
    for o in engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0)):
        assert len(o.text.strip()) >= 8 and any(c.isalpha() for c in o.text), o.text
    # After warmup no request of any kind compiles (counted in test_no_compilation_after_warmup).
    # The plain shape is compiled already: at most the logprobs variant (none if an earlier
    # module of the suite compiled it: tests/conftest.py keeps compiled shapes across modules).
    # Copy-on-write copies too: one per power of two up to max_num_seqs (fewer if compiled).
    assert engine.warmup() <= 1 + CONFIG.max_num_seqs.bit_length()
    compiled = engine.num_compilations
    lp = engine.generate([PROMPTS[2]] * 2, [
        SamplingParams(max_tokens=4, prompt_logprobs=3, logprobs=5, n=2, seed=1),
        SamplingParams(max_tokens=4, logprobs=0, temperature=0, stop="x")])
    assert lp[0].prompt_logprobs[1] and len(lp[0].outputs) == 2 and lp[1].outputs[0].logprobs
    assert engine.num_compilations == compiled
    app = build_app(engine, ServerSettings(served_model_name="tiny", max_waiting=256))
    with serve_in_thread(app) as base:
        yield {"base": base, "app": app, "offline": offline,
               "offline_n2": [o.text for o in offline_n2.outputs], "stop": stop, "lib": lib,
               "compiled": compiled, "engine": engine, "lib_prompt": lib_prompt,
               "client": openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)}


def test_health_and_models(server):
    assert httpx.get(server["base"] + "/health").status_code == 200
    models = server["client"].models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_greedy_completions_equal_offline(server):
    client = server["client"]
    for p in PROMPTS:
        r = client.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS,
                                      temperature=0)
        assert r.object == "text_completion" and r.id.startswith("cmpl-")
        assert r.choices[0].text == server["offline"][p]
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.prompt_tokens == len(p.encode()) + 1
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # A list of prompts: one choice per prompt, in order; token ids work like text.
    r = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=MAX_TOKENS,
                                  temperature=0)
    assert [c.text for c in r.choices] == [server["offline"][p] for p in PROMPTS[:2]]
    ids = [256] + list(PROMPTS[0].encode())
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
                                  echo=True)
    assert r.choices[0].text == PROMPTS[0] + server["offline"][PROMPTS[0]]


def test_stop_string_truncates(server):
    client = server["client"]
    full = server["offline"][PROMPTS[0]]
    stop = full[3:5]
    want = full[:full.index(stop)]
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                  temperature=0, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0],
                                            max_tokens=MAX_TOKENS, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_strings_and_max_tokens_none_offline_equal_the_server(server):
    client, stop, lib = server["client"], server["stop"], server["lib"]
    full = server["offline"][PROMPTS[0]]
    cut = lib["include_stop_str_in_output", False]
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (
        full[:full.index(stop)], "stop", stop)
    kept = lib["include_stop_str_in_output", True]
    assert kept.text == full[:full.index(stop) + len(stop)] and kept.stop_reason == stop
    assert kept.token_ids == cut.token_ids  # the tokens up to the one completing the match
    for include, want in ((False, cut), (True, kept)):
        r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                      temperature=0, stop=stop,
                                      extra_body={"include_stop_str_in_output": include})
        assert (r.choices[0].text, r.choices[0].finish_reason) == (want.text, "stop")
        assert r.usage.completion_tokens == len(want.token_ids)
    # max_tokens=None: up to max_model_len, as vLLM (offline and over HTTP alike).
    none = lib["none"]
    r = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=None, temperature=0)
    assert r.choices[0].text == none.text and r.choices[0].finish_reason == none.finish_reason
    n_prompt = len(PROMPTS[1].encode()) + 1
    assert none.finish_reason == "stop" or len(none.token_ids) == CONFIG.max_model_len - n_prompt
    assert none.stop_reason is None  # EOS or length


def test_stop_token_reason_and_bad_stop_params(server):
    ids = server["lib"]["include_stop_str_in_output", False].token_ids
    tok = server["lib"]["tok"]
    assert (tok.token_ids, tok.finish_reason, tok.stop_reason) == (ids[:2], "stop", ids[1])
    engine_free = SamplingParams(stop=["a", "bc"], max_tokens=None)
    assert engine_free.stop == ("a", "bc") and engine_free.max_tokens is None
    with pytest.raises(TypeError, match="stop"):
        SamplingParams(stop=3)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["x", ""])
    with pytest.raises(TypeError, match="include_stop_str_in_output"):
        SamplingParams(include_stop_str_in_output="yes")
    assert len(ids) >= 2
    r = server["client"].completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"stop_token_ids": [ids[1]]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 2
    # vLLM's stop_reason on every choice: the stop token id here.
    assert r.choices[0].model_extra["stop_reason"] == ids[1]


def test_stop_reason_is_the_matched_stop_string(server):
    client, stop = server["client"], server["stop"]
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                  temperature=0, stop=[stop, "zzz"])
    assert r.choices[0].model_extra["stop_reason"] == stop
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0],
                                            max_tokens=MAX_TOKENS, temperature=0, stop=stop,
                                            stream=True))
    assert chunks[-1].choices[0].model_extra["stop_reason"] == stop
    assert all(c.choices[0].model_extra["stop_reason"] is None for c in chunks[:-1])
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=MAX_TOKENS,
                                          temperature=0)
    text = full.choices[0].message.content
    assert full.choices[0].model_extra["stop_reason"] is None  # length or EOS
    if len(text) >= 3:
        cut = client.chat.completions.create(model="tiny", messages=msgs, temperature=0,
                                             max_tokens=MAX_TOKENS, stop=text[1:3])
        assert cut.choices[0].model_extra["stop_reason"] == text[1:3]
        last = list(client.chat.completions.create(model="tiny", messages=msgs, temperature=0,
                                                   max_tokens=MAX_TOKENS, stop=text[1:3],
                                                   stream=True))[-1]
        assert last.choices[0].model_extra["stop_reason"] == text[1:3]


def test_prompt_logprobs_and_echo_score_the_prompt(server):
    """vLLM's prompt_logprobs (as the library computes them) and OpenAI's echo + logprobs."""
    client, engine = server["client"], server["engine"]
    ids = [256] + list(PROMPTS[0].encode())
    lib = server["lib_prompt"]
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for pos in range(1, len(ids)):
        want = lib.prompt_logprobs[pos]
        assert {int(t) for t in got[pos]} == set(want) and str(ids[pos]) in got[pos]
        for t, v in want.items():
            assert got[pos][str(t)]["logprob"] == pytest.approx(v, abs=1e-5)
    for stream in (False, True):
        out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3,
                                        temperature=0, echo=True, logprobs=1, stream=stream)
        choices = [out.choices[0]] if not stream else [c.choices[0] for c in out]
        lp = choices[0].logprobs
        assert "".join(c.text for c in choices).startswith(PROMPTS[0])
        assert lp.tokens[:len(ids)] == [engine.tokenizer.decode([t]) for t in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:len(ids)] == pytest.approx(
            [lib.prompt_logprobs[i][ids[i]] for i in range(1, len(ids))], abs=1e-5)
        if not stream:
            assert len(lp.tokens) == len(ids) + 3 and lp.text_offset[0] == 0
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2,
                                  extra_body={"prompt_logprobs": 99})


def test_unknown_chat_role_is_400(server):
    client = server["client"]
    with pytest.raises(openai.BadRequestError, match="wizard") as e:
        client.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "wizard", "content": "hi"}])
    assert e.value.body["param"] == "messages[0].role"
    for role in ("system", "developer"):
        r = client.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": role, "content": "be brief"}, {"role": "user", "content": "hi"}])
        assert r.choices[0].finish_reason in ("stop", "length")


def test_no_compilation_after_warmup(server):
    """Every kind of request after ``warmup()``: plain, logprobs (k = 0 and 5), prompt logprobs
    and n = 2 (offline, in the fixture), chat top_logprobs, n = 2 streams, stop strings: no
    compilation (the engine's trace count is unchanged)."""
    client, msgs = server["client"], [{"role": "user", "content": "hi"}]
    client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=3, logprobs=0)
    client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=3, n=2, logprobs=4)
    client.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, logprobs=True,
                                   top_logprobs=2)
    list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, n=3,
                                        stream=True, stop=["a", "b"]))
    assert server["engine"].num_compilations == server["compiled"]


def test_64_concurrent_streams(server):
    client = server["client"]

    def one(i):
        p = PROMPTS[i % len(PROMPTS)]
        chunks = list(client.completions.create(
            model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert chunks[-2].choices[0].finish_reason in ("stop", "length")
        assert all(c.object == "text_completion" for c in chunks)
        return p, text

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(64)))
    for p, text in results:
        assert text == server["offline"][p]
    _wait_idle(server["base"])


def test_chat_streaming_and_n2(server):
    client = server["client"]
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=MAX_TOKENS,
                                          temperature=0)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs,
                                                 max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    # n=2 with a seed: the same two samples as offline.
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, n=2,
                                  temperature=0.8, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == server["offline_n2"]
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, n=2, seed=3,
                                                 max_tokens=MAX_TOKENS, stream=True))
    assert {c.choices[0].index for c in chunks} == {0, 1}
    assert sum(1 for c in chunks if c.choices[0].finish_reason) == 2


def test_logprobs(server):
    client = server["client"]
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                  temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == server["offline"][PROMPTS[0]]
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs) and all(2 <= len(t) <= 3 for t in lp.top_logprobs)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=MAX_TOKENS,
        temperature=0, logprobs=True, top_logprobs=3, stream=True))
    content = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert 1 <= len(content) <= MAX_TOKENS and all(len(e.top_logprobs) == 3 for e in content)


def test_disconnect_aborts_and_frees_blocks(server):
    base = server["base"]
    aborted = _metric(base, "paged:request_aborted_total")
    body = {"model": "tiny", "prompt": "def main():", "max_tokens": 100, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data:"):
                break  # one chunk, then hang up
    _wait_idle(base, timeout=10)
    assert _metric(base, "paged:request_aborted_total") == aborted + 1


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x" * 200}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": 500}, 400, "max_tokens"),
    ({"prompt": [1, 2, 99999]}, 400, "prompt"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
    ({"prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
])
def test_bad_requests(server, body, status, param):
    base = server["base"]
    body = {"model": "tiny", **body}
    r = httpx.post(base + "/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    if status == 404:
        assert err["code"] == "model_not_found"
    # The server keeps serving.
    ok = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "x",
                                                    "max_tokens": 2})
    assert ok.status_code == 200


def test_malformed_json_and_chat_errors(server):
    base = server["base"]
    r = httpx.post(base + "/v1/completions", content=b'{"prompt": "x"',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(base + "/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        server["client"].chat.completions.create(model="tiny", messages=[
            {"role": "user", "content": "hi"}], temperature=-1)


def test_503_when_waiting_queue_is_full(server):
    base, loop = server["base"], server["app"].state.loop
    loop.max_waiting = 1
    try:
        body = {"model": "tiny", "prompt": "def main():", "max_tokens": 40, "ignore_eos": True,
                "temperature": 0}

        def one(_):
            r = httpx.post(base + "/v1/completions", json=body, timeout=60)
            return r.status_code, r.json()

        with concurrent.futures.ThreadPoolExecutor(40) as pool:
            results = list(pool.map(one, range(40)))
    finally:
        loop.max_waiting = 256
    codes = [c for c, _ in results]
    assert 503 in codes and 200 in codes, codes
    busy = next(j for c, j in results if c == 503)["error"]
    assert busy["code"] == "server_busy" and set(busy) == {"message", "type", "param", "code"}
    assert all(len(j["choices"][0]["text"]) > 0 for c, j in results if c == 200)
    _wait_idle(base)


def test_bench_serving_smoke_against_the_server(server, tmp_path):
    from experiments import bench_serving, common

    out = tmp_path / "bench"
    c = common.load_config_file(str(ROOT / "experiments/configs/bench_serving.py") + ":smoke")
    c.base_url, c.model, c.output_dir = server["base"], "tiny", str(out)
    c.save_generated_texts = True
    bench_serving.main(c, bench_serving.check(c))
    payload = json.loads((out / "summary.json").read_text())
    # The keys a script written for vLLM's benchmark_serving result files reads.
    vllm_keys = ("date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate",
                 "burstiness", "max_concurrency", "duration", "completed", "total_input_tokens",
                 "total_output_tokens", "request_throughput", "output_throughput",
                 "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms",
                 "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
                 "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms",
                 "input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")
    missing = [k for k in vllm_keys if k not in payload]
    assert not missing, missing
    assert payload["num_prompts"] == 6 and payload["request_rate"] == c.workload.rate
    assert payload["max_concurrency"] is None and len(payload["generated_texts"]) == 6
    assert all(payload["generated_texts"]) and "provenance" in payload
    assert payload["completed"] == 6 and payload["errors"] == [""] * 6
    assert len(payload["ttfts"]) == 6 and all(t > 0 for t in payload["ttfts"])


@pytest.fixture(scope="module")
def cli():
    """One warm start-up (Python, JAX, the modules) for the command lines that fail fast."""
    with ForkRunner(["paged.server.cli", "experiments.bench_serving",
                     "experiments.online_vs_offline"], ROOT) as runner:
        yield runner


def test_cli_bad_value_is_one_line(cli):
    cases = ((["--max_num_seqs", "0"], "max_num_seqs"),
             (["--max-num-seqs", "x"], "max_num_seqs"),
             (["--bogus", "1"], "--bogus"),
             (["--dtype", "float8"], "dtype"),
             (["--request_timeout_s", "3"], "--request_timeout_s"),  # one spelling
             (["--speculative", "ngram:x"], "METHOD[:K]"),
             (["--speculative", '{"num_speculative_token": 2}'], "closest: num_speculative_tokens"),
             (["--max_num_seq", "4"], "--max_num_seq: did you mean --max_num_seqs?"))
    for flags, word in cases:
        proc = cli.run("paged.server", *flags, timeout=60)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith("paged.server: ") and word in lines[0], lines


def test_cli_help_lists_the_allowed_values():
    from paged.server.cli import build_parser

    text = " ".join(build_parser().format_help().split())
    for words in ("kv_cache_dtype (default 'auto'); one of: auto, int8, fp8_e4m3, fp8_e5m2",
                  "one of: prefix_aware, round_robin, least_loaded",
                  "one of: decode-first, prefill-first", "one of: recompute, swap",
                  "one of: continuous, static", "one of: float32, bfloat16",
                  "one of: auto, xla, reference, pallas"):
        assert words in text, words


def test_online_vs_offline_smoke(cli, tmp_path):
    out = tmp_path / "ovo"
    proc = cli.run("experiments.online_vs_offline",
                   "--config=experiments/configs/online_vs_offline.py:smoke",
                   f"--config.output_dir={out}", timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads((out / "summary.json").read_text())
    cmp = payload["loads"][0]["comparison"]
    for metric in ("ttft_ms", "itl_ms"):
        for p in ("p50", "p90", "p99"):
            row = cmp[metric][p]
            assert row["diff"] == pytest.approx(row["online"] - row["offline"])
    assert cmp["output_throughput"]["ratio"] > 0
    rep = payload["loads"][0]["repeats"][0]
    assert rep["online"]["completed"] == rep["offline"]["completed"] == 6
    assert len(rep["online"]["ttfts"]) == 6
    # The offline run started cold and replays exactly.
    from experiments import replay as rp

    [record] = rp.load_records(str(out))
    assert record["arm"] == f"offline {payload['loads'][0]['rate']:g}/s #0"
    assert record["fresh_engine"]
    got = rp.replay(record)
    assert got.ok, f"{got.divergence.format()}\nreproduce: {rp.replay_command(out)}"


@pytest.mark.parametrize("study, flag, word", [
    ("bench_serving", "--config.workload.rat=4", "workload.rate"),
    ("bench_serving", "--config.base_url=localhost:8000", "base_url"),
    ("online_vs_offline", "--config.engine.max_num_seq=4", "engine.max_num_seqs"),
    ("online_vs_offline", "--config.engine.block_size=0", "engine.block_size"),
])
def test_study_typo_or_bad_value_is_one_line(cli, tmp_path, study, flag, word):
    out = tmp_path / "out"
    proc = cli.run(f"experiments.{study}", f"--config=experiments/configs/{study}.py:smoke", flag,
                   f"--config.output_dir={out}", timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith(f"{study}: ") and word in lines[0], lines
    assert not out.exists()


def test_request_timeout_ends_the_stream_with_an_error(server):
    base, loop = server["base"], server["app"].state.loop
    body = {"model": "tiny", "prompt": "def main():", "max_tokens": 100, "ignore_eos": True,
            "temperature": 0}
    loop.request_timeout_s = 0.05
    try:
        r = httpx.post(base + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True},
                          timeout=30) as resp:
            events = [line[5:].strip() for line in resp.iter_lines() if line.startswith("data:")]
    finally:
        loop.request_timeout_s = None
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["type"] == "timeout_error"
    assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-2])
    _wait_idle(base)
