"""Replicas in parallel: host time per step of D data-parallel replicas, with every replica's host
half in the one engine thread (``Engine(config)``, the default) and in a process of its own
(``paged.server.replica_process.process_replicas``), against one replica.

Every arm serves ``num_running`` decoding sequences per replica with the device call stubbed out
(``paged.engine.device_step.stub_step``: tokens of the right shape at once), so a step's wall
time is the host's share: scheduling, batch build, read-back and outputs of every replica, plus,
for process replicas, the messages. Arms: ``one`` (one replica), ``thread D=d`` and
``process D=d`` for each ``d`` of ``config.replicas``. Each round times ``steps`` consecutive
``step()`` calls of every arm, the arms' order rotated from round to round, so a drift of a
shared machine shows as spread between rounds; the ratio of an arm to ``one`` is taken per round
(median [min, max] over rounds), beside the medians over every timed step. The machine's cores
(``os.cpu_count()``) and its load average before and after are recorded: D processes can run at
once only on D free cores.

The study forces ``max(replicas)`` CPU host devices itself (``XLA_FLAGS`` when it names no device
count; before JAX starts). Writes ``dp_host.json``.
"""

from __future__ import annotations

import os
import time

# The imports below come after the flag on purpose: JAX reads XLA_FLAGS when it starts.
# ruff: noqa: E402
if __name__ == "__main__":
    from experiments.host_devices import force_host_devices

    force_host_devices(int(os.environ.get("DP_HOST_DEVICES", "4")))

import numpy as np

from experiments import common
from paged import Engine, SamplingParams
from paged.engine.device_step import stub_step


def check(c) -> dict:
    common.check_model(c.model)
    common.check_unset(c.engine, ["max_num_seqs", "max_num_batched_tokens"],
                       "num_running / replicas")
    for key in ("num_running", "prompt_len", "steps", "rounds"):
        if isinstance(c[key], bool) or not isinstance(c[key], int) or c[key] < 1:
            raise ValueError(f"{key}={c[key]!r} must be an integer >= 1")
    if isinstance(c.warmup_steps, bool) or c.warmup_steps < 0:
        raise ValueError(f"warmup_steps={c.warmup_steps!r} must be an integer >= 0")
    if not c.replicas or any(isinstance(d, bool) or not isinstance(d, int) or d < 2
                             for d in c.replicas):
        raise ValueError(f"replicas={tuple(c.replicas)!r} must be integers >= 2")
    need = c.warmup_steps + c.rounds * c.steps + 4
    if c.prompt_len + need > c.engine.max_model_len:
        raise ValueError(f"prompt_len={c.prompt_len} + {need} steps exceed engine.max_model_len="
                         f"{c.engine.max_model_len}: a sequence would finish while timed")
    config = lambda d: common.make_engine_config(
        c.engine, model=c.model, max_num_seqs=c.num_running,
        max_num_batched_tokens=max(c.num_running, 256), data_parallel_size=d)
    return {"arms": [("one", 1, config(1))] + [
        (f"{kind} D={d}", d, config(d)) for d in c.replicas for kind in ("thread", "process")]}


def build(name: str, config, model) -> object:
    if name.startswith("process"):
        from paged.server.replica_process import process_replicas

        return process_replicas(config, model_config=model[0], params=model[1])
    return Engine(config, model_config=model[0], params=model[1])


class _Arm:
    """One engine serving ``num_running`` decoding sequences per replica, device stubbed."""

    def __init__(self, name: str, d: int, engine, c, seed: int):
        self.name, self.d, self.engine = name, d, engine
        self.expect = c.num_running * d
        engine.set_device_step(stub_step)
        rng = np.random.default_rng(seed)
        params = SamplingParams(max_tokens=c.engine.max_model_len - c.prompt_len,
                                temperature=0.0, ignore_eos=True)
        for i in range(self.expect):
            engine.add_request(f"s{i}", [256] + rng.integers(0, 256, c.prompt_len - 1).tolist(),
                               params)
        for _ in range(c.prompt_len + c.warmup_steps + 2):  # prefill (chunks), then decoding
            engine.step()
        self.walls: list[float] = []
        self.rounds: list[float] = []

    def block(self, steps: int) -> None:
        walls = []
        for _ in range(steps):
            t0 = time.perf_counter()
            self.engine.step()
            walls.append(time.perf_counter() - t0)
            if self.engine.last_timing.num_seqs != self.expect:
                raise RuntimeError(f"{self.name}: stepped {self.engine.last_timing.num_seqs} "
                                   f"sequences, expected {self.expect}")
        self.walls += walls
        self.rounds.append(float(np.median(walls)))

    def close(self) -> None:
        for r in getattr(self.engine, "replicas", []):
            if hasattr(r, "close"):
                r.close()


def main(c, plan):
    out_dir = common.output_dir(c, "dp_host")
    model = common.load_model(c.model)
    load_before = os.getloadavg()
    arms, build_s = [], {}
    for i, (name, d, config) in enumerate(plan["arms"]):
        t0 = time.perf_counter()
        arms.append(_Arm(name, d, build(name, config, model), c, seed=i))
        build_s[name] = time.perf_counter() - t0
        print(f"{name}: built and filled in {build_s[name]:.1f} s", flush=True)
    for r in range(c.rounds):
        k = r % len(arms)
        for arm in arms[k:] + arms[:k]:
            arm.block(c.steps)
    one = arms[0]
    rows = []
    for arm in arms:
        ratios = [a / b for a, b in zip(arm.rounds, one.rounds, strict=True)]
        rows.append({"arm": arm.name, "replicas": arm.d, "steps": len(arm.walls),
                     "median_step_ms": 1e3 * float(np.median(arm.walls)),
                     "p90_step_ms": 1e3 * float(np.percentile(arm.walls, 90)),
                     "round_median_step_ms": [1e3 * x for x in arm.rounds],
                     "ratio_to_one": common.spread(ratios), "build_s": build_s[arm.name]})
        print(f"{arm.name:12s} host {rows[-1]['median_step_ms']:7.3f} ms/step  x one "
              f"{rows[-1]['ratio_to_one']['median']:.2f} [{rows[-1]['ratio_to_one']['min']:.2f}, "
              f"{rows[-1]['ratio_to_one']['max']:.2f}]", flush=True)
    for arm in arms:
        arm.close()
    out = out_dir / "dp_host.json"
    common.write_result(out, {
        "study": "dp_host", "evidence": "constructed", "config": c.to_dict(),
        "definition": "host time per step = wall time of step() with every replica's device "
                      "call stubbed out; ratio_to_one = per-round median over one replica's, "
                      "median [min, max] over rounds",
        "machine": {"cpu_count": os.cpu_count(), "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg()},
        "arms": rows, "provenance": common.provenance()})
    print(f"wrote {out}")


if __name__ == "__main__":
    common.run("dp_host", main, check)
