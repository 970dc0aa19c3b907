"""A simulated request's ``RequestRecord``: from its final output, or for one never admitted.

Shared by the colocated loop (``paged.sim.simulator``) and the disaggregated one
(``paged.sim.disagg``). Every simulated result is labelled ``evidence: "simulated"``.
"""

from __future__ import annotations

from paged import metrics

EVIDENCE = "simulated"
STATUS = {"stop": "finished", "length": "finished", "abort": "aborted", "timeout": "timeout"}


def record_of(out, prompt_len: int) -> metrics.RequestRecord:
    """A finished request's ``RequestOutput`` as a ``RequestRecord`` (simulated times)."""
    status = STATUS.get(out.finish_reason, "aborted")
    return metrics.RequestRecord(
        request_id=out.request_id, status=status, arrival_s=out.arrival_time,
        first_scheduled_s=out.first_scheduled_time, first_token_s=out.first_token_time,
        finish_s=out.finish_time, token_times=tuple(out.token_times), prompt_len=prompt_len,
        output_len=len(out.token_ids), num_preemptions=out.num_preemptions,
        num_cached_tokens=out.num_cached_tokens)


def rejected_record(spec, now: float) -> metrics.RequestRecord:
    return metrics.RequestRecord(
        request_id=spec.request_id, status="rejected", arrival_s=spec.arrival_s,
        first_scheduled_s=None, first_token_s=None, finish_s=None, token_times=(),
        prompt_len=spec.prompt_len, output_len=0)


__all__ = ["EVIDENCE", "STATUS", "record_of", "rejected_record"]
