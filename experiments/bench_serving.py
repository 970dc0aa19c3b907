"""HTTP benchmark client: one workload, in real time, against an OpenAI-compatible server.

Every request of the workload (`paged.workload.workload`, made as the serving studies make it) is sent at
its arrival time as a streaming ``POST /v1/completions`` with the prompt as token ids,
``max_tokens`` = its output length, ``ignore_eos: true``, ``temperature: 0`` and
``stream_options.include_usage``, with ``httpx`` (asyncio). It measures what a client sees:

- TTFT: first chunk with text - the request's scheduled arrival time;
- ITL: gaps between consecutive chunks with text (a chunk may carry several tokens when the
  server merges steps; vLLM's benchmark measures the same way);
- E2E: the ``[DONE]`` event - arrival; TPOT = (E2E - TTFT) / (output tokens - 1), the output
  token count being the server's ``usage.completion_tokens`` (per sample when ``n > 1``).

A request answered with an HTTP error (503 when the server's queue is full) is ``rejected``; one
whose stream ends in an error event (a server-side timeout) ``timeout``, and one that fails on the
client side (connection error, the client's own timeout) ``aborted``; each stays in the results
with its message in ``error_messages``. The JSON uses vLLM ``benchmark_serving``'s field names at
its top level (`paged.workload.metrics.summarize`: ``duration``, ``completed``, ``request_throughput``,
``output_throughput``, ``{mean,median,std,p90,p99}_{ttft,tpot,itl,e2el}_ms``, ``ttfts``,
``itls``, ``input_lens``, ``output_lens``, ``errors``), so it reads like vLLM's and like the
in-process serving studies'; queue times are unknown to a client (``*_queue_ms`` are None).

Works against any OpenAI-compatible server that accepts token-id prompts and vLLM's
``ignore_eos`` (this repository's ``paged.server``, vLLM, SGLang): set ``--config.base_url`` and
``--config.model`` to the server's model id.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from experiments import common, serving
from paged.workload import metrics
from paged.workload.workload import Workload, check_same_evidence


def check(c) -> dict:
    """Checks every setting and builds the workload (no request sent yet)."""
    if not isinstance(c.base_url, str) or not c.base_url.startswith(("http://", "https://")):
        raise ValueError(f"base_url={c.base_url!r} must start with http:// or https://")
    if not isinstance(c.model, str) or not c.model:
        raise ValueError(f"model={c.model!r} must be a non-empty string (the server's model id)")
    if not isinstance(c.endpoint, str) or not c.endpoint.startswith("/"):
        raise ValueError(f"endpoint={c.endpoint!r} must be a path such as /v1/completions")
    if not isinstance(c.save_generated_texts, bool):
        raise TypeError(f"save_generated_texts={c.save_generated_texts!r} must be true or false")
    common.check_positive(max_model_len=c.max_model_len, request_timeout_s=c.request_timeout_s,
                          ttft_slo_ms=c.ttft_slo_ms, tpot_slo_ms=c.tpot_slo_ms)
    if isinstance(c.max_concurrency, bool) or not isinstance(c.max_concurrency, int) or \
            c.max_concurrency < 0:
        raise ValueError(f"max_concurrency={c.max_concurrency!r} must be an integer >= 0 "
                         "(0: no limit)")
    workload = serving.build_workload(c.workload, c.max_model_len)
    check_same_evidence([workload])
    return {"workload": workload}


async def _one(client, url: str, model: str, spec, t0: float, sem) -> dict:
    """Sends one request and reads its stream; returns what happened (times are perf_counter)."""
    arrival = t0 + spec.arrival_s
    payload = {"model": model, "prompt": spec.engine_prompt(), "max_tokens": spec.output_len,
        "temperature": 0.0, "ignore_eos": True, "n": spec.n, "stream": True,
        "stream_options": {"include_usage": True}}
    times: list[float] = []
    result = {"spec": spec, "arrival": arrival, "times": times, "status": "finished",
              "error": "", "completion_tokens": None, "finish": None, "text": ""}
    import httpx

    try:
        async with sem:
            async with client.stream("POST", url, json=payload) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    result.update(status="rejected", error=f"HTTP {resp.status_code}: {body[:300]}",
                                  finish=time.perf_counter())
                    return result
                # SSE events are split here from the raw bytes (cheaper than aiter_lines, and
                # the client's CPU competes with the server's when both share a machine).
                buf, done = b"", False
                async for data in resp.aiter_bytes():
                    now = time.perf_counter()
                    buf += data.replace(b"\r\n", b"\n") if b"\r" in data else data
                    *events, buf = buf.split(b"\n\n")
                    for event in events:
                        for line in event.split(b"\n"):
                            if not line.startswith(b"data:"):
                                continue
                            payload_ = line[5:].strip()
                            if payload_ == b"[DONE]":
                                done = True
                                break
                            _event(json.loads(payload_), now, result)
                    if done:
                        break
        result["finish"] = time.perf_counter()
        if result["status"] == "finished" and not times:
            result.update(status="aborted", error="the stream carried no text")
    except (httpx.HTTPError, OSError, ValueError) as e:
        result.update(status="aborted", error=f"{type(e).__name__}: {e}"[:300],
                      finish=time.perf_counter())
    return result


def _event(obj: dict, now: float, result: dict) -> None:
    """One ``data:`` event of a stream: a chunk with text (a token time), usage, or an error."""
    if "error" in obj:
        result.update(status="timeout", error=json.dumps(obj["error"])[:300])
        return
    choices = obj.get("choices") or []
    if any(ch.get("index", 0) == 0 and (ch.get("text") or (ch.get("delta") or {}).get("content"))
           for ch in choices):
        result["times"].append(now)
    for ch in choices:
        if ch.get("index", 0) == 0:
            result["text"] += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
    if obj.get("usage"):
        result["completion_tokens"] = obj["usage"].get("completion_tokens")


def _record(r: dict) -> tuple[metrics.RequestRecord, list[float]]:
    """The request's record, and its chunk gaps (the ITLs a client sees)."""
    spec, times = r["spec"], r["times"]
    gaps = [b - a for a, b in zip(times, times[1:])]
    if r["status"] != "finished":
        return metrics.RequestRecord(
            request_id=spec.request_id, status=r["status"], arrival_s=r["arrival"],
            first_scheduled_s=None, first_token_s=times[0] if times else None,
            finish_s=r["finish"] if times else None, token_times=(),
            prompt_len=spec.prompt_len, output_len=0), gaps
    out = r["completion_tokens"]
    out = max(1, (out // spec.n) if out is not None else len(times))
    return metrics.RequestRecord(
        request_id=spec.request_id, status="finished", arrival_s=r["arrival"],
        first_scheduled_s=r["arrival"], first_token_s=times[0], finish_s=max(r["finish"], times[-1]),
        token_times=(), prompt_len=spec.prompt_len, output_len=out), gaps


async def _run_all(base_url: str, endpoint: str, model: str, workload: Workload, *,
                   max_concurrency: int, timeout_s: float, progress: bool) -> tuple[list, float]:
    import httpx

    specs = sorted(workload.requests, key=lambda s: s.arrival_s)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else _NoLimit()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    bar = common.Progress(len(specs), "[bench_serving]") if progress else None
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(timeout_s),
                                 limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        for spec in specs:
            delay = t0 + spec.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(_one(client, endpoint, model, spec, t0, sem))
            if bar is not None:
                task.add_done_callback(lambda _: bar.update())
            tasks.append(task)
        results = await asyncio.gather(*tasks)
    if bar is not None:
        bar.close()
    return results, t0


class _NoLimit:
    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


def benchmark(base_url: str, model: str, workload: Workload, *, endpoint: str = "/v1/completions",
              max_concurrency: int = 0, timeout_s: float = 600.0, ttft_slo_ms=None,
              tpot_slo_ms=None, progress: bool = True) -> tuple[dict, list[metrics.RequestRecord]]:
    """Runs ``workload`` against the server at ``base_url``; returns (summary, records).

    The summary is `paged.workload.metrics.summarize`'s over the client-side records, with the ITL fields
    (``*_itl_ms``, ``itls``) from chunk gaps and ``error_messages`` beside ``errors``.
    """
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per request
    results, t0 = asyncio.run(_run_all(base_url, endpoint, model, workload,
                                       max_concurrency=max_concurrency, timeout_s=timeout_s,
                                       progress=progress))
    pairs = [_record(r) for r in results]
    records = [rec for rec, _ in pairs]
    end = max([r.finish_s for r in records if r.finish_s is not None], default=time.perf_counter())
    summary = metrics.summarize(records, duration_s=max(end - t0, 1e-9), ttft_slo_ms=ttft_slo_ms,
                                tpot_slo_ms=tpot_slo_ms, evidence=workload.evidence)
    done_gaps = [g for rec, gaps in pairs if rec.status == "finished" for g in gaps]
    summary.update(metrics.stats_ms("itl", done_gaps))
    summary.update(metrics.stats_ms("queue", []))
    summary["itl_population"] = (f"gaps between text chunks of finished requests "
                                 f"({len(done_gaps)} gaps)")
    summary["itls"] = [gaps for _, gaps in pairs]
    summary["error_messages"] = [r["error"] for r in results]
    summary["generated_texts"] = [r["text"] for r in results]
    return summary, records


def vllm_fields(c, workload: Workload, summary: dict) -> dict:
    """The top-level fields of vLLM's ``benchmark_serving`` result file that the summary lacks,
    so a script written for those files reads ours unchanged (``generated_texts`` only with
    ``config.save_generated_texts``, as vLLM's ``--save-detailed``)."""
    import datetime

    out = {"date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
           "backend": "openai-chat" if "chat" in c.endpoint else "openai",
           "model_id": c.model, "tokenizer_id": c.model, "num_prompts": len(workload),
           "request_rate": c.workload.rate, "burstiness": c.workload.burstiness,
           "max_concurrency": c.max_concurrency or None}
    if c.save_generated_texts:
        out["generated_texts"] = summary["generated_texts"]
    return out


def run(c, out_dir: Path, plan: dict | None = None) -> dict:
    plan = plan or check(c)
    workload = plan["workload"]
    print(f"workload: {len(workload)} requests, evidence={workload.evidence}, against "
          f"{c.base_url}{c.endpoint} (model {c.model})")
    summary, records = benchmark(c.base_url, c.model, workload, endpoint=c.endpoint,
                                 max_concurrency=c.max_concurrency, timeout_s=c.request_timeout_s,
                                 ttft_slo_ms=c.ttft_slo_ms, tpot_slo_ms=c.tpot_slo_ms)
    texts = summary.pop("generated_texts")
    payload = {
        "study": "bench_serving", "base_url": c.base_url,
        **vllm_fields(c, workload, {"generated_texts": texts}),
        **summary,
        "config": c.to_dict(),
        "workload": {"name": workload.name, "seed": workload.seed, "meta": workload.meta,
                     "summary": workload.summary()},
        "records": [r.as_dict() for r in records],
        "provenance": common.provenance(),
    }
    path = common.write_result(out_dir / "summary.json", payload)
    print(serving.format_table([serving.ArmResult(
        name="http", summary={**summary, "engine_preemptions": None,
                              "prefix_cache_hit_tokens": None},
        records=records, trace={}, engine_config={}, wall_s=summary["duration"],
        num_compilations=0)]))
    print(f"wrote {path}")
    return payload


def main(c, plan):
    run(c, common.output_dir(c, "bench_serving"), plan)


if __name__ == "__main__":
    common.run("bench_serving", main, check)
