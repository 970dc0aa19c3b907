"""What a step reports: ``RequestOutput`` per request, ``CompletionOutput`` per sample."""

from __future__ import annotations

from collections.abc import Callable

from paged.request.sequence import Sequence


class CompletionOutput:
    """One sample of a request, as of the step that produced it.

    Built on every step for every active request, so it is cheap: it keeps a reference to the
    sequence's token list (which only ever grows) and the slice that was current, and decodes
    ``text`` only when asked.


    ``stop_reason`` is vLLM's: ``None`` unless the sample ended with ``finish_reason="stop"``
    on a stop token (its id) or a stop string (the string; ``text`` then ends before it, or after
    it with ``include_stop_str_in_output``); ``None`` for EOS.
    """

    __slots__ = ("index", "finish_reason", "stop_reason", "_ids", "_start", "_end", "_decode",
                 "_text", "_lps")

    def __init__(self, index: int, ids: list[int], start: int, end: int,
                 finish_reason: str | None, decode: Callable[[list[int]], str],
                 logprobs: list | None = None, stop: tuple | None = None):
        self.index = index
        self.finish_reason = finish_reason  # "stop" | "length" | "abort" | "timeout" | None
        self._ids, self._start, self._end, self._decode, self._text = ids, start, end, decode, None
        self._lps = logprobs
        # ``stop``: the sequence's (stop_reason, stop_text) when it finished with "stop".
        self.stop_reason = None if stop is None else stop[0]
        if stop is not None and stop[1] is not None:
            self._text = stop[1]

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        """Per generated token, token id -> log-probability (the sampled token and the top k;
        ``SamplingParams.logprobs``), or ``None`` when not asked for."""
        return None if self._lps is None else self._lps[:self._end - self._start]

    @property
    def token_ids(self) -> list[int]:
        return self._ids[self._start:self._end]

    @property
    def num_token_ids(self) -> int:
        """``len(token_ids)`` without copying them."""
        return self._end - self._start

    def token_ids_from(self, k: int) -> list[int]:
        """``token_ids[k:]``, copying only those: a streaming consumer's per-step delta (it
        keeps the count it has seen; the whole list is never copied again)."""
        return self._ids[self._start + k:self._end]

    def logprobs_from(self, k: int) -> list[dict[int, float]] | None:
        """``logprobs[k:]`` (``None`` when not asked for), copying only those."""
        return None if self._lps is None else self._lps[k:self._end - self._start]

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self._decode(self.token_ids)
        return self._text

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, token_ids={self.token_ids}, "
                f"finish_reason={self.finish_reason!r})")


class RequestOutput:
    """A request's state after a step (cumulative tokens), built cheaply on every step.

    ``token_ids`` / ``text`` / ``finish_reason`` are those of sample 0; all samples are in
    ``outputs``. Times are ``time.perf_counter()`` seconds. What can still change later (token
    counts, finish reasons, preemption and cache counters) is recorded when the output is made;
    lists are sliced from the sequences' own append-only lists when read, so an output stays a
    faithful snapshot of its step.

    Three stored fields: the first sequence, its token count, and a tuple of the rest
    (``state_of``), which an unfinished single-sample request shares between steps
    (``Sequence.out_state``), so making the output of a decode step costs one small object.
    """

    __slots__ = ("_head", "_end", "_state", "_outputs")

    def __init__(self, head: Sequence, end: int, state: tuple):
        """``head``: the request's first sequence; ``end``: its token count now; ``state``:
        ``state_of``'s tuple."""
        self._head, self._end, self._state = head, end, state

    # Recorded when the output was made (see ``state_of``).
    request_id = property(lambda self: self._state[0])
    finished = property(lambda self: self._state[1])
    finish_time = property(lambda self: self._state[2])
    num_preemptions = property(lambda self: self._state[3])
    num_cached_tokens = property(lambda self: self._state[4])
    finish_reason = property(lambda self: self._state[5])
    # Of ``num_cached_tokens`` (both tiers), the prompt tokens loaded from the host tier.
    num_host_cached_tokens = property(lambda self: self._state[8])

    @property
    def outputs(self) -> list[CompletionOutput]:
        """One ``CompletionOutput`` per sample so far (samples not forked yet are absent)."""
        try:
            return self._outputs
        except AttributeError:
            pass
        head, state = self._head, self._state
        samples = ((head, self._end, state[5]), *state[6])
        decode = state[7]
        self._outputs = [CompletionOutput(
            s.sample_index, s.token_ids, s.num_prompt_tokens, end, reason, decode, s.logprobs,
            (s.stop_reason, s.stop_text) if reason == "stop" else None)
            for s, end, reason in samples]
        return self._outputs

    # Set once, before any output of the request exists (or never), so read through.
    arrival_time = property(lambda self: self._head.arrival_time)
    first_scheduled_time = property(lambda self: self._head.first_scheduled_time)
    first_token_time = property(lambda self: self._head.first_token_time)

    @property
    def prompt_logprobs(self) -> list[dict[int, float] | None] | None:
        """Per prompt position: ``None`` at 0, then the actual token's and the top k tokens'
        log-probabilities (``SamplingParams.prompt_logprobs``); ``None`` when not asked for.
        Positions not computed yet are ``None`` too."""
        lps = self._head.prompt_logprobs
        return None if lps is None else list(lps)

    @property
    def prompt_token_ids(self) -> list[int]:
        head = self._head
        return head.token_ids[:head.num_prompt_tokens]

    @property
    def token_times(self) -> list[float]:
        """Sample 0: the time each output token arrived on the host."""
        head = self._head
        return head.token_times[:self._end - head.num_prompt_tokens]

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, finished={self.finished}, "
                f"outputs={self.outputs})")


class OutputDeltas:
    """Turns a request's cumulative outputs into per-step deltas for one consumer (the server's
    streams, the engine-core wire): it remembers, per request and sample, how many tokens it has
    handed out, and copies only the new ones (``CompletionOutput.token_ids_from``), so a stream
    of n tokens costs O(n) in all instead of O(n) per step."""

    def __init__(self):
        self._sent: dict[str, dict[int, int]] = {}  # request id -> sample index -> tokens handed

    def take(self, out, logprobs: bool = True) -> list[tuple]:
        """Per sample of ``out`` (a ``RequestOutput`` or the core client's ``RemoteOutput``):
        (sample, new token ids, new log-probabilities or ``None``). Forgets a finished request."""
        sent = self._sent.setdefault(out.request_id, {})
        got = []
        for o in out.outputs:
            k = sent.get(o.index, 0)
            sent[o.index] = o.num_token_ids
            got.append((o, o.token_ids_from(k), o.logprobs_from(k) if logprobs else None))
        if out.finished:
            del self._sent[out.request_id]
        return got

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


def state_of(seqs: list[Sequence], finished: bool, finish_time: float | None,
              decode: Callable[[list[int]], str]) -> tuple:
    """A ``RequestOutput``'s recorded fields: request id, finished, finish time, preemptions
    (all samples), cached prompt tokens, sample 0's finish reason, the other samples'
    (sequence, token count, finish reason), the tokenizer's decode, and the cached prompt tokens
    loaded from the host tier."""
    head = seqs[0]
    others = tuple((s, s.num_known_tokens, s.finish_reason) for s in seqs[1:])
    preemptions = head.num_preemptions if not others else sum(s.num_preemptions for s in seqs)
    return (head.request_id, finished, finish_time, preemptions, head.num_cached_tokens,
            head.finish_reason, others, decode, head.num_host_cached_tokens)


def output_fields(out: RequestOutput) -> tuple:
    return (out.request_id, out.finished, out.finish_time, out.num_preemptions, out.num_cached_tokens,
            out.num_host_cached_tokens,
            out.arrival_time, out.first_scheduled_time, out.first_token_time, out.prompt_token_ids,
            out.token_times, [(o.index, o.token_ids, o.finish_reason) for o in out.outputs])


def check_outputs(made, request_output: Callable[[str], RequestOutput]) -> None:
    """Debug: each output made on the batched path equals the one made from the request table."""
    for out in made:
        if out:
            want = request_output(out.request_id)
            assert output_fields(out) == output_fields(want), (out, want)


def collect_outputs(ended, decode, made, touched, final_output, requests) -> list:
    """A step's outputs: the ``ended`` requests', then the decodes' (``made[i]``: made already;
    ``None``: made now, once per request; ``False``: none), then the ``touched`` requests'; each
    request once; an unfinished ``output_kind="final_only"`` request is left out.
    ``final_output(request_id)`` makes one (and forgets a finished request)."""
    outs = [final_output(r) for r in ended]
    done = set()  # requests whose output was made here
    if None in made or False in made:
        for seq, out in zip(decode, made):
            if out is False:
                continue
            if out is None:
                if seq.request_id in done or seq.request_id not in requests:
                    continue
                done.add(seq.request_id)
                out = final_output(seq.request_id)
                if not _reported(out):
                    continue
            outs.append(out)
    else:
        outs += made
    for r in touched:
        if r not in done and r in requests:
            out = final_output(r)
            if _reported(out):
                outs.append(out)
    return outs


def _reported(out: RequestOutput) -> bool:
    """Whether ``out`` is reported now: a finished request always is, an unfinished one unless
    it asked for its final output only (``SamplingParams.output_kind``)."""
    return out.finished or out._head.params.output_kind != "final_only"
