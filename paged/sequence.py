"""Host-side state of one sequence (one sample of one request)."""

from __future__ import annotations

import dataclasses
import enum

from paged.sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not on device: new, or preempted by recompute
    RUNNING = "running"  # owns device blocks
    SWAPPED = "swapped"  # KV parked in host slots
    FINISHED = "finished"


@dataclasses.dataclass(eq=False, slots=True)
class Sequence:
    """One sample of a request. ``token_ids`` is prompt + generated tokens.

    ``num_computed_tokens`` counts the tokens whose KV is on device; the tokens after it are
    the ones the next step computes. A sequence is *decoding* once only its last token is left.

    While a decode run holds it (``run`` is set), ``token_ids``, ``token_times`` and
    ``num_computed_tokens`` lag the run's steps; ``paged.decode_run.sync(seq)`` brings them up to
    date (the engine, the scheduler and ``RequestOutput`` do so before they read them).
    """

    seq_id: int
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    arrival_time: float
    sample_index: int = 0
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    num_slots: int = 0  # slots the block manager holds for it (mirrors ``bm.num_tokens``)
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at the last admission
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    num_preemptions: int = 0
    deadline: float | None = None
    row: int = -1  # its row in the batch builder's persistent tables while it runs; -1 = none
    out_state: tuple | None = None  # the engine's cached output fields (``Engine`` only)
    # The steady decode run that holds its newest tokens (``paged.decode_run``), and its column.
    run: object | None = None
    run_col: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_uncomputed == 1 and self.num_output_tokens > 0

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
