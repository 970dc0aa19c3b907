"""A workload's arrivals replayed into a real engine on a measured-step clock: each request is
added once the clock reaches its arrival, the clock advances by each step's measured wall time,
and an idle engine jumps to the next arrival. Used where a real run is compared with the
simulator (`experiments/cache_agreement.py`, tests/test_sim.py). Host code: the engine is
duck-typed (``add_request``, ``step``, ``has_unfinished_requests``, ``num_steps``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from paged.request.sampling import SamplingParams
from paged.workload.request_spec import RequestSpec


def replay_arrivals(engine, specs: Sequence[RequestSpec],
                    on_step: Callable[[float, float], None] | None = None) -> float:
    """Runs ``specs`` through ``engine`` until all finish; returns the clock at the end (s).

    Requests are taken in arrival order (a stable sort: ties keep their order), each with
    ``SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)`` and its
    arrival time. ``on_step(start_s, duration_s)`` is called after every ``engine.step()`` that
    ran a batch (``engine.num_steps`` grew), with the clock when it started and its wall time;
    a call that ran nothing does not advance the clock.
    """
    specs = sorted(specs, key=lambda r: r.arrival_s)
    clock, i = 0.0, 0
    while i < len(specs) or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            clock = max(clock, specs[i].arrival_s)
        while i < len(specs) and specs[i].arrival_s <= clock:
            r = specs[i]
            engine.add_request(r.request_id, r.engine_prompt(),
                               SamplingParams(max_tokens=r.output_len, temperature=0.0,
                                              ignore_eos=True), arrival_time=r.arrival_s)
            i += 1
        n = engine.num_steps
        t = time.perf_counter()
        engine.step()
        d = time.perf_counter() - t
        if engine.num_steps > n:  # a step ran
            if on_step is not None:
                on_step(clock, d)
            clock += d
    return clock
