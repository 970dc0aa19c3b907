"""Online vs offline: one workload served in-process and over HTTP, side by side.

Offline: the engine in this process, driven in real time by `experiments.serving.run_arm` (what
``serve`` does). Online: ``python -m paged.server`` started here as a subprocess on 127.0.0.1 with
a free port and the same engine settings (every `EngineConfig` field passed as a flag, warmed up
before it serves), measured by `experiments.bench_serving` (streaming ``/v1/completions``,
token-id prompts, ``ignore_eos``, greedy), then stopped. The two arms run one after the other, so
neither competes with the other for the CPU, ``config.repeats`` times per request rate of
``config.rates``, alternating; every run has its own workload seed (both arms of a run share it),
so no prefix-cache hit carries over from an earlier run. CPU seconds are recorded per run: the
in-process arm's (this process, the engine alone), the server process's and the HTTP client's
(this process), since on a small machine the client's CPU competes with the server's too. Per rate, the headline comparison is
over the per-arm medians of each statistic across repeats; every run's own comparison is kept.

With ``config.engine_process`` the server runs its engine core in a child process
(``--engine_process true``): the online arm then measures that split, and the server's CPU
seconds include the child's.

Reported: TTFT and ITL at p50 / p90 / p99 for both and their differences (online - offline; the
ITL difference is the server's added cost per token), output and request throughput and their
ratio (online / offline) at the same offered load. Offline ITLs are gaps between the engine's
token times; online ITLs are gaps between text chunks as the client receives them (a chunk may
carry more than one token when the server merges steps), so both are what a user of each path
sees. Writes ``summary.json`` (the comparison, every repeat's summaries, config, provenance;
per-request arrays only with ``config.per_request``) and ``replay.json`` (each offline run, arm
``offline <rate>/s #<repeat>``: the one engine's prefix cache is emptied before each, so each
starts cold and ``python -m experiments.replay --from=<dir>`` re-executes it exactly; the online
arm runs in the server process and is not recorded).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments import bench_serving, common, serving
from experiments.replay import replay_command
from paged.workload.workload import check_same_evidence

PERCENTILES = (("p50", "median"), ("p90", "p90"), ("p99", "p99"))


def check(c) -> dict:
    serving.check_serving(c)
    common.check_positive(request_timeout_s=c.request_timeout_s,
                          server_start_timeout_s=c.server_start_timeout_s)
    if isinstance(c.repeats, bool) or not isinstance(c.repeats, int) or c.repeats < 1:
        raise ValueError(f"repeats={c.repeats!r} must be an integer >= 1")
    rates = tuple(c.rates) or (c.workload.rate,)
    for i, rate in enumerate(rates):
        common.check_positive(**{f"rates[{i}]": rate})
    engine_config = serving.engine_config(c, {})
    loads = []
    for i, rate in enumerate(rates):
        workloads = []
        for r in range(c.repeats):
            w = c.workload.copy_and_resolve_references()
            w.rate = float(rate)
            # New prompts for every run: no prefix-cache hit carries over from an earlier one.
            w.seed = c.workload.seed + i * c.repeats + r
            workloads.append(serving.build_workload(w, engine_config.max_model_len))
        loads.append((float(rate), workloads))
    check_same_evidence([w for _, ws in loads for w in ws])
    return {"loads": loads, "engine": engine_config}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flag(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def server_command(engine_config, model: str, port: int, extra=()) -> list[str]:
    """``python -m paged.server`` with every EngineConfig field of ``engine_config``."""
    cmd = [sys.executable, "-m", "paged.server", "--host", "127.0.0.1", "--port", str(port),
           "--served_model_name", model, "--warmup", "true", *extra]
    from paged.server.cli import SERVER_SPELLED

    for f in dataclasses.fields(engine_config):
        value = model if f.name == "model" else getattr(engine_config, f.name)
        if f.name in SERVER_SPELLED:  # a server flag of another name (request_timeout_s)
            if value is not None:
                cmd += [f"--{SERVER_SPELLED[f.name]}", _flag(value)]
            continue
        cmd += [f"--{f.name}", _flag(value)]
    return cmd


def start_server(engine_config, model: str, timeout_s: float,
                 extra=()) -> tuple[subprocess.Popen, str]:
    """Starts the server and waits until ``/health`` answers 200; returns (process, base URL)."""
    import logging

    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per health poll
    port = _free_port()
    # A file, not a pipe: a server that logs a lot must never block on a full pipe.
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115  (lives as long as the process)
    proc = subprocess.Popen(server_command(engine_config, model, port, extra), stdout=log, stderr=log,
                            text=True)
    proc.log = log
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"paged.server exited with {proc.returncode}: "
                               f"{log.read()[-2000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    stop_server(proc)
    raise RuntimeError(f"paged.server did not answer /health within {timeout_s} s")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def compare(offline: dict, online: dict) -> dict:
    """Per-percentile TTFT / ITL / TPOT / E2E side by side, and the throughput ratios."""
    out = {}
    for metric in ("ttft", "itl", "tpot", "e2el"):
        rows = {}
        for label, stat in PERCENTILES:
            a, b = offline.get(f"{stat}_{metric}_ms"), online.get(f"{stat}_{metric}_ms")
            rows[label] = {"offline": a, "online": b,
                           "diff": None if a is None or b is None else b - a}
        out[f"{metric}_ms"] = rows
    for key in ("output_throughput", "request_throughput"):
        a, b = offline.get(key), online.get(key)
        out[key] = {"offline": a, "online": b, "ratio": b / a if a and b is not None else None}
    return out


def format_comparison(cmp: dict) -> str:
    lines = [f"{'':24s}{'offline':>12s}{'online':>12s}{'diff':>12s}"]
    for metric in ("ttft", "itl", "tpot"):
        for label, _ in PERCENTILES:
            row = cmp[f"{metric}_ms"][label]
            cells = ["-" if row[k] is None else f"{row[k]:.2f}" for k in ("offline", "online",
                                                                           "diff")]
            lines.append(f"{label + ' ' + metric.upper() + ' (ms)':24s}"
                         + "".join(f"{v:>12s}" for v in cells))
    for key in ("output_throughput", "request_throughput"):
        row = cmp[key]
        ratio = "-" if row["ratio"] is None else f"x{row['ratio']:.3f}"
        lines.append(f"{key:24s}{row['offline']:>12.2f}{row['online']:>12.2f}{ratio:>12s}")
    return "\n".join(lines)


_PER_REQUEST = ("input_lens", "output_lens", "ttfts", "itls", "errors", "error_messages",
                "failed_request_ids")


def _trim(summary: dict, keep: bool) -> dict:
    return dict(summary) if keep else {k: v for k, v in summary.items() if k not in _PER_REQUEST}


def median_summary(summaries: list[dict]) -> dict:
    """Per key, the median over repeats of every numeric statistic (None if any is None)."""
    out = {}
    for key in summaries[0]:
        vals = [s.get(key) for s in summaries]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[key] = float(statistics.median(vals))
    return out


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds so far of process ``pid`` and its live descendants (the
    engine-core process of ``--engine_process``) (Linux ``/proc``; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    for child in _children(pid):
        total += process_cpu_s(child) or 0.0
    return total


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            out += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except (OSError, ValueError):
        pass
    return out


def _one_load(c, engine, proc, base: str, rate: float, workloads, replays=None) -> dict:
    """Every repeat at one rate: offline then online, alternating; their median comparison.
    ``replays`` gets each offline run's replay record."""
    repeats = []
    for r, workload in enumerate(workloads):
        # Alternating arms, each idle while the other runs (the server waits on its loop's
        # condition), so a change in the machine's load hits both alike.
        serving.start_cold(engine)  # one engine for every offline run: each starts cold, replays
        cpu0 = time.process_time()
        offline = serving.run_arm(f"offline {rate:g}/s #{r}", engine, workload,
                                  ttft_slo_ms=c.ttft_slo_ms, tpot_slo_ms=c.tpot_slo_ms,
                                  max_wall_s=c.max_wall_s, model_name=c.model)
        if replays is not None:
            replays.append(offline.replay)
        cpu1, server0 = time.process_time(), process_cpu_s(proc.pid)
        online, _ = bench_serving.benchmark(base, c.model, workload, timeout_s=c.request_timeout_s,
                                            ttft_slo_ms=c.ttft_slo_ms, tpot_slo_ms=c.tpot_slo_ms)
        cpu2, server1 = time.process_time(), process_cpu_s(proc.pid)
        cpu = {"offline_engine_s": cpu1 - cpu0, "online_client_s": cpu2 - cpu1,
               "online_server_s": None if server0 is None else server1 - server0,
               "online_output_tokens": online["total_output_tokens"],
               "offline_output_tokens": offline.summary["total_output_tokens"]}
        repeats.append({"seed": workload.seed, "offline": offline.summary, "online": online,
                        "comparison": compare(offline.summary, online), "cpu": cpu})
    for x in repeats:
        ratio, diff = (x["comparison"]["output_throughput"]["ratio"],
                       x["comparison"]["itl_ms"]["p50"]["diff"])
        cpu = x["cpu"]
        server = "-" if cpu["online_server_s"] is None else f"{cpu['online_server_s']:.2f}"
        print(f"rate {rate:g}/s, seed {x['seed']}: output throughput x"
              f"{'-' if ratio is None else f'{ratio:.3f}'}, p50 ITL diff "
              f"{'-' if diff is None else f'{diff:+.2f}'} ms, online completed "
              f"{x['online']['completed']}/{x['online']['num_requests']}; CPU s: offline "
              f"{cpu['offline_engine_s']:.2f}, server {server}, client "
              f"{cpu['online_client_s']:.2f}")
    cmp = compare(median_summary([x["offline"] for x in repeats]),
                  median_summary([x["online"] for x in repeats]))
    print(f"rate {rate:g}/s, median over {len(repeats)} repeats:")
    print(format_comparison(cmp))
    return {"rate": rate, "comparison": cmp,
            "comparison_is": f"median over {len(repeats)} repeats of each statistic, per arm",
            "repeats": [{**x, "offline": _trim(x["offline"], c.per_request),
                         "online": _trim(x["online"], c.per_request)} for x in repeats]}


def run(c, out_dir: Path, plan: dict | None = None) -> dict:
    plan = plan or check(c)
    loads, engine_config = plan["loads"], plan["engine"]
    first = loads[0][1][0]
    print(f"workload: {len(first)} requests, rates {[r for r, _ in loads]} req/s, "
          f"{c.repeats} repeats each, evidence={first.evidence}")
    load_before = _loadavg()
    model = common.load_model(c.model)
    engine = serving.build_engine(engine_config, model)
    extra = ("--engine_process", "true") if c.engine_process else ()
    proc, base = start_server(engine_config, c.model, c.server_start_timeout_s, extra)
    try:
        with common.Progress(len(loads), "[online_vs_offline]", unit="load") as bar:
            results, replays = [], []
            for rate, workloads in loads:
                results.append(_one_load(c, engine, proc, base, rate, workloads, replays))
                bar.update()
    finally:
        stop_server(proc)
    del engine, model
    payload = {
        "study": "online_vs_offline", "evidence": first.evidence, "config": c.to_dict(),
        "workload": {"name": first.name, "meta": first.meta, "summary": first.summary()},
        "engine_config": dataclasses.asdict(engine_config),
        "loads": results,
        # Other jobs on the machine compete with both arms: the load average (1, 5, 15 min)
        # before and after says how quiet it was.
        "machine": {"cpu_count": os.cpu_count(), "loadavg_before": load_before,
                    "loadavg_after": _loadavg()},
        "provenance": common.provenance(),
    }
    path = common.write_result(out_dir / "summary.json", payload)
    print(f"wrote {path}")
    if serving.write_replay_records(out_dir / "replay.json", replays):
        print(f"replay (offline runs): {replay_command(out_dir)}")
    return payload


def main(c, plan):
    run(c, common.output_dir(c, "online_vs_offline"), plan)


if __name__ == "__main__":
    common.run("online_vs_offline", main, check)
