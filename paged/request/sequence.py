"""Host-side state of one sequence (one sample of one request).

A sequence's token state (token ids, the time each output token arrived, how many tokens have KV
on device, how many slots the block manager holds) has exactly one owner at a time: the
``InputBatch`` row while the sequence runs, the sequence itself otherwise. ``InputBatch.add`` and
``InputBatch.remove`` move it between the two, so nothing is kept twice and nothing lags.
"""

from __future__ import annotations

import enum

from paged.request.sampling import SamplingParams

UNKNOWN = -1  # a token sampled by a step whose result has not reached the host yet


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not on device: new, or preempted by recompute
    RUNNING = "running"  # owns device blocks (and an input-batch row)
    SWAPPED = "swapped"  # KV parked in host slots
    TRANSFER = "transfer"  # prefilled, its KV waiting to move to a decode replica (no row)
    LOADING = "loading"  # admitted; waits for its host-tier prefix blocks to reach the device
    FINISHED = "finished"


class Sequence:
    """One sample of a request. ``token_ids`` is prompt + generated tokens.

    ``num_computed_tokens`` counts the tokens whose KV is on device (or will be, once the step in
    flight completes); the tokens after it are the ones the next step computes. A sequence is
    *decoding* once only its last token is left. With an overlapped step the newest token may be
    ``UNKNOWN`` (``pending``) until the step that samples it is read back; such a token is never
    shown to a reader of ``token_ids`` through an output (outputs end before it).

    ``num_cached_tokens``: prompt tokens served by the prefix cache at the first admission (a
    re-admission after recompute preemption may hit more, but those are not the request's prompt
    savings).
    """

    __slots__ = ("seq_id", "request_id", "num_prompt_tokens", "params", "seed", "arrival_time",
                 "sample_index", "status", "num_cached_tokens", "num_host_cached_tokens",
                 "first_scheduled_time",
                 "first_token_time", "finish_time", "finish_reason", "num_preemptions", "deadline",
                 "cache_salt", "out_state", "row", "batch", "_tokens", "_times", "_computed",
                 "_slots", "logprobs", "prompt_logprobs", "stop_reason", "stop_text", "stop_watch",
                 "_dropped", "kv_next", "kv_pos_key")

    def __init__(self, seq_id: int, request_id: str, token_ids: list[int], num_prompt_tokens: int,
                 params: SamplingParams, seed: int, arrival_time: float, *, sample_index: int = 0,
                 deadline: float | None = None, cache_salt: bytes | None = None):
        self.seq_id = seq_id
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.params = params
        self.seed = seed
        self.arrival_time = arrival_time
        self.sample_index = sample_index
        self.status = SeqStatus.WAITING
        self.num_cached_tokens = 0
        self.num_host_cached_tokens = 0  # of those, loaded from the host tier
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.finish_reason: str | None = None  # "stop" | "length" | "abort" | "timeout"
        # Set when it stops (``paged.request.stop_strings.stop_reason``): vLLM's ``stop_reason`` (None for
        # EOS, a stop token id, a stop string) and, for a stop string, the text to show.
        self.stop_reason: int | str | None = None
        self.stop_text: str | None = None
        self.stop_watch = None  # its stop-string search (``stop_strings.StopWatch``), when used
        self.num_preemptions = 0
        self.deadline = deadline
        self.cache_salt = cache_salt
        # The engine's cached output fields (``paged.request.outputs.state_of``); False: the request
        # reports only when it finishes (``output_kind="final_only"``); None: not made yet.
        self.out_state: tuple | bool | None = None
        self.row = -1  # its input-batch row while running (then ``batch`` owns the token state)
        self.batch = None
        self._tokens: list[int] = list(token_ids)
        self._times: list[float] = []  # arrival time of each output token
        self._computed = 0
        self._slots = 0
        # KV policies (docs/kv-policies.md): positions dropped so far (slots = positions -
        # dropped: what attention reads), the computed count at which the policy runs next (-1:
        # at the prompt's end) and the record of its compacted slots' positions (a
        # ``paged.step.kv_policy_runner.PosRecord``; None: slot i holds position i).
        self._dropped = 0
        self.kv_next = -1
        self.kv_pos_key = None
        # Per output token, its log-probability dict (``SamplingParams.logprobs``), and per prompt
        # position (``prompt_logprobs``, ``None`` at 0); ``None`` when not asked for.
        self.logprobs: list | None = None if params.logprobs is None else []
        self.prompt_logprobs: list | None = None
        if params.prompt_logprobs is not None and sample_index == 0:
            self.prompt_logprobs = [None] * num_prompt_tokens

    def fork(self, seq_id: int, sample_index: int,
             sampled: tuple[int, int] | None = None) -> Sequence:
        """A new sample of the same request with this sequence's tokens so far (not running).

        ``sampled``: ``(position, token)``: the child's own sample at ``position`` (the parent's
        last slot, just sampled), which replaces the parent's token there; the child then holds
        the parent's slots."""
        child = Sequence(seq_id, self.request_id, self.token_ids, self.num_prompt_tokens,
                         self.params, self.seed, self.arrival_time, sample_index=sample_index,
                         deadline=self.deadline, cache_salt=self.cache_salt)
        child.num_cached_tokens = self.num_cached_tokens
        child.num_host_cached_tokens = self.num_host_cached_tokens
        child.first_scheduled_time = self.first_scheduled_time
        child.first_token_time = self.first_token_time
        child.num_preemptions = self.num_preemptions
        child._computed = self.num_computed_tokens
        child._dropped = self.num_dropped
        child.kv_next, child.kv_pos_key = self.kv_next, self.kv_pos_key
        if self.logprobs is not None:
            child.logprobs = list(self.logprobs)
        if sampled is not None:
            p, token = sampled
            child._tokens[p] = token  # its own sample (the arrival time is the parent's)
            child._slots = self.num_slots
        return child

    # --- the token state (owned by the input batch while running) -------------------------
    def give_token_state(self, batch, row: int) -> tuple[list[int], list[float], int, int]:
        """Hands the token state to ``batch``'s row ``row`` (``InputBatch.add``): returns
        (token ids, output-token times, computed count, slot count); from now on the sequence
        reads it through to the row."""
        state = (self._tokens, self._times, self._computed, self._slots)
        self._tokens, self._times = [], []
        self.row, self.batch = row, batch
        return state

    def take_token_state(self, tokens: list[int], times: list[float], computed: int,
                         slots: int) -> None:
        """Takes the token state back from its row (``InputBatch.remove``)."""
        self._tokens, self._times, self._computed, self._slots = tokens, times, computed, slots
        self.row, self.batch = -1, None

    @property
    def token_ids(self) -> list[int]:
        if self.row >= 0:
            return self.batch.token_ids(self.row)
        return self._tokens

    @property
    def token_times(self) -> list[float]:
        if self.row >= 0:
            return self.batch.token_times(self.row)
        return self._times

    @property
    def num_tokens(self) -> int:
        if self.row >= 0:
            return int(self.batch.num_tokens[self.row])
        return len(self._tokens)

    @property
    def num_known_tokens(self) -> int:
        """Tokens up to (not including) a trailing ``UNKNOWN`` one: what outputs show."""
        if self.row >= 0:
            n = int(self.batch.num_tokens[self.row])
            return n - 1 if n and self.batch.tokens[self.row, n - 1] == UNKNOWN else n
        ids = self._tokens
        return len(ids) - 1 if ids and ids[-1] == UNKNOWN else len(ids)

    @property
    def num_computed_tokens(self) -> int:
        if self.row >= 0:
            return int(self.batch.num_computed[self.row])
        return self._computed

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        if self.row >= 0:
            self.batch.num_computed[self.row] = value
        else:
            self._computed = value

    @property
    def num_slots(self) -> int:
        """Slots the block manager holds for it (mirrors ``BlockManager.num_tokens``)."""
        if self.row >= 0:
            return int(self.batch.num_slots[self.row])
        return self._slots

    @num_slots.setter
    def num_slots(self, value: int) -> None:
        if self.row >= 0:
            self.batch.num_slots[self.row] = value
        else:
            self._slots = value

    @property
    def num_dropped(self) -> int:
        """Positions a KV policy dropped: the KV holds ``num_computed_tokens - num_dropped``
        slots (a RoPE position is not a slot index once this is > 0)."""
        if self.row >= 0:
            return int(self.batch.dropped[self.row])
        return self._dropped

    @num_dropped.setter
    def num_dropped(self, value: int) -> None:
        if self.row >= 0:
            self.batch.dropped[self.row] = value
        else:
            self._dropped = value

    def forget_kv_policy(self) -> None:
        """Its KV is gone (preempted by recompute): the policy starts over with the prompt."""
        self.num_dropped, self.kv_next, self.kv_pos_key = 0, -1, None

    def tokens(self, start: int, end: int) -> list[int | None]:
        """Token ids ``start:end``, ``None`` where not known yet (for the block manager)."""
        ids = self.batch.tokens[self.row, start:end].tolist() if self.row >= 0 else \
            self._tokens[start:end]
        return [None if t == UNKNOWN else t for t in ids] if UNKNOWN in ids else ids

    @property
    def pending(self) -> bool:
        """Its newest token was sampled by a step not read back yet (or it awaits a fork)."""
        if self.row >= 0:
            return bool(self.batch.hold[self.row])
        return bool(self._tokens) and self._tokens[-1] == UNKNOWN

    def set_sampled(self, pos: int, token: int, now: float) -> None:
        """Fills the token at ``pos`` (``UNKNOWN`` until now) and its arrival time."""
        if self.row >= 0:
            self.batch.tokens[self.row, pos] = token
            self.batch.times[self.row, pos] = now
        else:
            self._tokens[pos] = token
            self._times.append(now)

    def drop_unknown(self) -> None:
        """Forgets a trailing ``UNKNOWN`` token (its step's result is discarded)."""
        if self.row < 0 and self._tokens and self._tokens[-1] == UNKNOWN:
            self._tokens.pop()

    # --- derived ---------------------------------------------------------------------------
    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_uncomputed == 1 and self.num_output_tokens > 0

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(seq_id={self.seq_id}, request_id={self.request_id!r}, "
                f"status={self.status.value}, num_tokens={self.num_tokens}, "
                f"num_computed={self.num_computed_tokens})")
