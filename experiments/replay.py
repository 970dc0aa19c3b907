"""Exact replay of a serving run: ``python -m experiments.replay --from=<results dir>``.

A serving run (`experiments.serving.run_arm`) records what is needed to run it again
(``ArmResult.replay``; every serving study writes them to ``replay.json`` beside its results,
one per run, via ``serving.write_replay_records``):
the engine config and model, the seeds, every admitted request (prompt token ids, sampling,
arrival offset; a digest over them), and per ``engine.step()`` call the requests added before it,
the requests it reported aborted or timed out, its batch (``[request_id, sample_index,
num_new_tokens]`` in batch order), its preemptions and the requests it reported finished.

The replay rebuilds the engine and re-executes the run in lockstep, with no wall clock: each
request is added before the step it was added before originally (its arrival time keeps its
original offset, so arrival order, and with it preemption order, is the same), and each step's
composition is compared with the record. A request that timed out is replayed as an abort before
the step whose start expired it (a timeout is a wall-clock event; the engine's
``request_timeout_s`` is off in the replay), so its reported reason is ``abort`` and only its
tokens are compared. The replay stops at the first step that differs and prints both sides;
otherwise it compares every request's final tokens. Exit status 0: identical; 1: a difference.
``--sim`` replays the record on the simulator instead (``replay_sim``: the same host core and
scheduler, pseudo-tokens; schedules compared, not tokens; serial runs only, since the simulator
does not model the overlapped step; single-replica runs only).

Data-parallel runs (``data_parallel_size`` D > 1) replay in lockstep too: the record holds, per
request, the replica the router sent it to, and per step every replica's batch and preemptions.
The replay builds the same D replicas (it needs D x T devices: on CPU, set
``XLA_FLAGS=--xla_force_host_platform_device_count=<D x T>`` before the run; ``replay_command``
prints it), routes each request with the recorded router policy and compares its replica
(``replica of <id>``) before the step, then each step's per-replica composition.

Only a run that started cold replays (``serving.cold_start``: no request in flight, no cached
prefix block, a router that has routed nothing): a replay starts on a new engine, and a warm
prefix cache is state the record does not hold. Studies that serve several points on one engine
therefore empty its prefix cache before each point (``Engine.reset_prefix_cache()``, vLLM's seam;
data parallel, a new ``router`` too), so every point starts cold and replays alone; a study that
builds an engine per point needs nothing. A record of a warm run is refused with one line.
Serving runs sample greedily, so an unseeded request's seed (which derives from the engine's
request count) cannot change a token. The model is recorded by name: the replay loads it with
``common.load_model`` (a run on other weights differs).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

from experiments import common
from paged import Engine, EngineConfig
from paged.config.speculative import SpeculativeConfig

FIELDS = ("ended", "preempted", "batch", "finished")  # compared per step, in this order


@dataclasses.dataclass(frozen=True)
class Divergence:
    """The first difference: at ``step`` (0-based ``engine.step()`` call; ``None``: the final
    tokens), ``field`` was ``expected`` in the record and ``got`` in the replay."""

    step: int | None
    field: str
    expected: object
    got: object

    def format(self) -> str:
        where = "final tokens" if self.step is None else f"step {self.step}"
        return (f"replay differs at {where} ({self.field}):\n"
                f"  recorded: {json.dumps(self.expected)}\n"
                f"  replayed: {json.dumps(self.got)}")


@dataclasses.dataclass(frozen=True)
class ReplayResult:
    arm: str
    num_steps: int  # steps compared equal
    divergence: Divergence | None

    @property
    def ok(self) -> bool:
        return self.divergence is None


def engine_config(record: dict, **overrides) -> EngineConfig:
    """The recorded ``EngineConfig`` (timeouts off: they are replayed as aborts), plus
    ``overrides`` (a test's deliberate change)."""
    d = dict(record["engine_config"])
    if d.get("speculative") is not None:
        d["speculative"] = SpeculativeConfig(**d["speculative"])
    d = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    d["request_timeout_s"] = None
    d.update(overrides)
    return EngineConfig(**d)


def check_record(record) -> dict:
    """Raises ValueError unless ``record`` looks like one arm's replay record."""
    if not isinstance(record, dict):
        raise ValueError(f"a replay record is a JSON object, not {type(record).__name__}")
    missing = [k for k in ("version", "arm", "model", "engine_config", "requests", "steps",
                           "tokens") if k not in record]
    if missing:
        raise ValueError(f"replay record lacks {missing}")
    if record["version"] != 1:
        raise ValueError(f"replay record version {record['version']!r}; this replays version 1")
    if not record.get("fresh_engine", True):
        raise ValueError(f"arm {record['arm']!r} started warm (requests in flight, cached prefix "
                         f"blocks or a used router, not recorded): a replay starts on a new "
                         f"engine; reset the engine before the run (engine.reset_prefix_cache())")
    return record


def num_devices(record: dict) -> int:
    """Devices the recorded engine ran on (data-parallel x tensor-parallel size)."""
    c = record["engine_config"]
    return int(c.get("data_parallel_size", 1)) * int(c.get("tensor_parallel_size", 1))


def replay(record: dict, model=None, **overrides) -> ReplayResult:
    """Re-executes one recorded arm in lockstep (module docstring).

    Args:
      record: one arm's record (``ArmResult.replay``).
      model: ``(model_config, params)``; default ``common.load_model(record["model"])``.
      overrides: ``EngineConfig`` fields to change (a deliberate difference must be caught).
    """
    record = check_record(record)
    if model is None:
        model = common.load_model(record["model"])
    from experiments.serving import request_params

    engine = Engine(engine_config(record, **overrides), model_config=model[0], params=model[1])
    got_steps = engine.record_steps()
    requests = {r["request_id"]: r for r in record["requests"]}
    tokens: dict[str, list[int]] = {}
    base = time.perf_counter()
    for k, step in enumerate(record["steps"]):
        for rid in step["added"]:
            r = requests[rid]
            engine.add_request(rid, r["prompt"], request_params(r["output_len"], r["n"]),
                               arrival_time=base + r["arrival_s"])
            if "replica" in r and engine.routed[rid] != r["replica"]:  # data parallel
                return ReplayResult(record["arm"], k, Divergence(
                    k, f"replica of {rid}", r["replica"], engine.routed[rid]))
        for rid in step["ended"]:  # aborts, and timeouts replayed as aborts
            engine.abort(rid)
        finished = []
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.token_ids)
                finished.append(out.request_id)
        got = {**got_steps[-1], "finished": finished}
        for field in FIELDS:
            if _jsonable(got[field]) != step[field]:
                return ReplayResult(record["arm"], k, Divergence(k, field, step[field],
                                                                 _jsonable(got[field])))
    for rid, want in record["tokens"].items():
        if tokens.get(rid) != want:
            return ReplayResult(record["arm"], len(record["steps"]),
                                Divergence(None, f"tokens of {rid}", want, tokens.get(rid)))
    return ReplayResult(record["arm"], len(record["steps"]), None)


def replay_sim(record: dict, **overrides) -> ReplayResult:
    """The same record on the simulator (``paged.sim.replica.SimReplica``: the same ``HostCore``,
    ``Scheduler`` and ``BlockManager``, no device, pseudo-tokens), in lockstep: each recorded
    step's adds and aborts, then one simulated step; compares each step's batch (request id and
    token count per row), preemptions and finished requests. Tokens are not compared (the
    simulator samples pseudo-tokens). The simulator steps serially, so only a run with
    ``async_scheduling=False`` (or speculation, which is serial too) has the same schedule.

    Raises:
      ValueError: a record of an overlapped (``async_scheduling``) run.
    """
    from experiments.serving import request_params
    from paged.sim.linear_model import LinearStepModel
    from paged.sim.replica import SimReplica

    record = check_record(record)
    config = engine_config(record, **overrides)
    if config.data_parallel_size > 1:
        raise ValueError(f"arm {record['arm']!r} ran on {config.data_parallel_size} data-parallel "
                         f"replicas; the simulator replays single-replica runs")
    if config.async_scheduling and config.speculative is None:
        raise ValueError(f"arm {record['arm']!r} ran overlapped (async_scheduling=True); the "
                         f"simulator steps serially: it replays runs with async_scheduling=False")
    sim = SimReplica(config, LinearStepModel(coef={}), fast_forward=False, record_schedule=True)
    requests = {r["request_id"]: r for r in record["requests"]}
    now = 0.0
    for k, step in enumerate(record["steps"]):
        for rid in step["added"]:
            r = requests[rid]
            sim.add_request(rid, r["prompt"], request_params(r["output_len"], r["n"]),
                            arrival_time=r["arrival_s"])
        for rid in step["ended"]:
            sim.abort(rid, now)
        logged = len(sim.schedule_log)
        duration, outs = sim.begin(now)
        if duration is not None:
            now += duration
            outs = sim.finish(now)
        now += 1e-6
        batch, preempted = [], []
        if len(sim.schedule_log) > logged:
            _, ran, preempted = sim.schedule_log[-1]
            batch = [[rid, n] for rid, n in ran]
        got = {"batch": batch, "preempted": list(preempted),
               "finished": [o.request_id for o in outs if o.finished]}
        want = {"batch": [[rid, n] for rid, _, n in step["batch"]],
                "preempted": [rid for rid, _ in step["preempted"]], "finished": step["finished"]}
        for field in ("preempted", "batch", "finished"):
            if got[field] != want[field]:
                return ReplayResult(record["arm"], k, Divergence(k, field, want[field], got[field]))
    return ReplayResult(record["arm"], len(record["steps"]), None)


def _jsonable(x):
    return json.loads(json.dumps(x))


def load_records(results_dir: str) -> list[dict]:
    """The arms' records in ``<results_dir>/replay.json``. Raises ValueError naming the file."""
    path = Path(results_dir) / "replay.json"
    if not Path(results_dir).is_dir():
        raise ValueError(f"--from={results_dir!r}: no such directory")
    if not path.is_file():
        raise ValueError(f"{path}: no such file (a serving run writes it next to summary.json)")
    try:
        payload = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    arms = payload.get("arms") if isinstance(payload, dict) else None
    if not isinstance(arms, list) or not arms:
        raise ValueError(f"{path}: no 'arms' list of replay records")
    return [check_record(a) for a in arms]


def replay_command(results_dir, arm: str | None = None, *, devices: int = 1) -> str:
    """The command line that replays ``results_dir`` (one arm, or all); ``devices`` > 1 (a
    data-parallel run) prefixes the ``XLA_FLAGS`` that give a CPU that many devices."""
    env = "" if devices <= 1 else f"XLA_FLAGS=--xla_force_host_platform_device_count={devices} "
    return (f"{env}python -m experiments.replay --from={shlex.quote(str(results_dir))}"
            + ("" if arm is None else f" --arm={shlex.quote(arm)}"))


def check_devices(records: list[dict], results_dir) -> None:
    """Raises ValueError (with the command that works) if JAX sees fewer devices than a
    record's run used."""
    import jax

    need = max(num_devices(r) for r in records)
    have = len(jax.devices())
    if need > have:
        raise ValueError(f"the record ran on {need} devices but JAX sees {have} "
                         f"({jax.default_backend()}); on CPU run: "
                         f"{replay_command(results_dir, devices=need)}")


def main(argv=None) -> int:
    from absl import flags

    fl = flags.FlagValues()
    flags.DEFINE_string("from", None, "results dir holding replay.json", flag_values=fl)
    flags.DEFINE_string("arm", None, "replay only this arm (default: every arm)", flag_values=fl)
    flags.DEFINE_bool("sim", False, "replay on the simulator (schedules only; serial runs)",
                      flag_values=fl)
    try:
        rest = fl(sys.argv if argv is None else ["replay", *argv])
    except flags.Error as e:
        common.fail("replay", str(e))
    if len(rest) > 1:
        common.fail("replay", f"unexpected arguments {rest[1:]}; use --from=<results dir>")
    if fl["from"].value is None:
        common.fail("replay", "--from=<results dir> is required")
    try:
        records = load_records(fl["from"].value)
        if fl.arm is not None:
            names = [r["arm"] for r in records]
            if fl.arm not in names:
                raise ValueError(f"--arm={fl.arm!r}: the record has arms {names}")
            records = [r for r in records if r["arm"] == fl.arm]
        common.check_model(records[0]["model"])
        if not fl.sim:
            check_devices(records, fl["from"].value)
        else:
            for record in records:
                if num_devices(record) > 1:
                    raise ValueError(f"--sim: arm {record['arm']!r} ran on "
                                     f"{num_devices(record)} devices; the simulator replays "
                                     f"single-device runs")
                if engine_config(record).async_scheduling and record["engine_config"].get(
                        "speculative") is None:
                    raise ValueError(f"--sim: arm {record['arm']!r} ran overlapped; the "
                                     f"simulator replays runs with async_scheduling=False")
    except (ValueError, TypeError) as e:
        common.fail("replay", str(e))
    status = 0
    models = {}
    for record in records:
        name = record["model"]
        if fl.sim:
            result = replay_sim(record)
        else:
            if name not in models:
                models[name] = common.load_model(name)
            result = replay(record, models[name])
        if result.ok:
            what = "schedules (simulator)" if fl.sim else f"{len(record['tokens'])} requests' tokens"
            print(f"[{result.arm}] identical: {result.num_steps} steps, {what}", flush=True)
        else:
            print(f"[{result.arm}] {result.divergence.format()}", flush=True)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
