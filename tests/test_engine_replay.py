"""`paged.workload.engine_replay.replay_arrivals`: arrivals admitted against the measured-step
clock, an idle engine jumping to the next arrival, ``on_step`` only for steps that ran."""

from paged.workload.engine_replay import replay_arrivals
from paged.workload.request_spec import RequestSpec


class _FakeEngine:
    """Runs each request for ``steps`` steps, one step a call; an empty call runs nothing."""

    def __init__(self, steps=2):
        self.steps, self.left, self.num_steps, self.added = steps, {}, 0, []

    def add_request(self, request_id, prompt, params, arrival_time):
        self.added.append((request_id, arrival_time, params.max_tokens, params.ignore_eos))
        self.left[request_id] = self.steps

    def has_unfinished_requests(self):
        return bool(self.left)

    def step(self):
        if self.left:
            self.num_steps += 1
            self.left = {k: v - 1 for k, v in self.left.items() if v > 1}


def _spec(rid, arrival):
    return RequestSpec(rid, arrival, (1, 2, 3), None, 3, 4)


def test_arrival_order_idle_jump_and_steps_reported():
    engine, ran = _FakeEngine(), []
    specs = [_spec("late", 100.0), _spec("a", 0.0), _spec("b", 0.0)]  # out of order, a tie
    end = replay_arrivals(engine, specs, lambda start, d: ran.append((start, d)))
    assert [a[0] for a in engine.added] == ["a", "b", "late"]  # sorted, the tie kept in order
    assert engine.added[0][2:] == (4, True)
    assert len(ran) == engine.num_steps == 4
    starts = [s for s, _ in ran]
    assert starts[0] == 0.0 and starts[2] == 100.0  # idle after two steps: jumps to the arrival
    assert starts[1] == ran[0][1] and end == 100.0 + ran[2][1] + ran[3][1]
