"""When a sample stops, and the text it shows: stop tokens, stop strings, lengths (vLLM's rules).

One implementation for the library (``SamplingParams(stop=..., max_tokens=None)``, checked by
`StepReader.stops` on every sampled token) and the HTTP server (which passes the request's
``stop`` into ``SamplingParams`` and only holds streamed text back, `paged.server.streams`).

The order of the checks is vLLM's (``vllm.v1.engine.detokenizer`` / ``StopChecker``): EOS (unless
``ignore_eos``) -> ``stop_token_ids`` -> stop strings -> ``max_tokens`` / ``max_model_len``. The
``stop_reason`` of a finished sample is vLLM's ``CompletionOutput.stop_reason``: ``None`` for EOS
and lengths, the token id for a stop token, the string for a stop string. A stop string is
searched in the detokenized output text (incrementally: only the part that can contain a new
match); on a match the text ends before it (after it with ``include_stop_str_in_output``), while
``token_ids`` keep every token sampled up to the one that completed the match.

`Detokenizer` (incremental decoding, O(new tokens) per step) is shared with the server's streams.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_REPLACEMENT = "\ufffd"


class Detokenizer:
    """Incremental ``decode`` of a growing list of token ids.

    It keeps two offsets into the ids and emits ``decode(ids[prefix:]) - decode(ids[prefix:read])``,
    holding text back while it ends in U+FFFD (a multi-byte character whose last bytes have not
    arrived); at the end (``final=True``) the held text is flushed as it decodes.
    """

    __slots__ = ("_decode", "_prefix", "_read", "text")

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self._decode = decode
        self._prefix = self._read = 0
        self.text = ""

    def update(self, ids: Sequence[int], final: bool = False) -> str:
        """Text of ``ids`` (which extend the ids of the previous call) as far as it is settled."""
        if len(ids) > self._read:
            before = self._decode(ids[self._prefix:self._read])
            now = self._decode(ids[self._prefix:])
            if len(now) > len(before) and (final or not now.endswith(_REPLACEMENT)):
                self.text += now[len(before):]
                self._prefix, self._read = self._read, len(ids)
        return self.text


def check_stops(value) -> tuple[str, ...]:
    """``SamplingParams.stop``: ``None``, a non-empty str, or a list/tuple of them -> a tuple.

    Raises:
      TypeError: not a str or a list/tuple of str.
      ValueError: an empty string.
    """
    if value is None:
        return ()
    stops = (value,) if isinstance(value, str) else value
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise TypeError(f"stop={value!r:.80} must be a str or a list of str")
    if any(not s for s in stops):
        raise ValueError(f"stop={value!r:.80} must not contain an empty string")
    return tuple(stops)


def find_stop(text: str, stops: Sequence[str], start: int) -> tuple[int, str] | None:
    """The earliest match of any of ``stops`` in ``text`` at or after ``start``: (position,
    string), or ``None``."""
    best = None
    for s in stops:
        p = text.find(s, start)
        if p >= 0 and (best is None or p < best[0]):
            best = (p, s)
    return best


class StopWatch:
    """One sample's stop-string search over its incrementally detokenized output."""

    __slots__ = ("detok", "stops", "hold", "hit")

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: tuple[str, ...]):
        self.detok = Detokenizer(decode)
        self.stops = stops
        self.hold = max(len(s) for s in stops) - 1
        self.hit: tuple[str, str] | None = None

    def update(self, output_ids: Sequence[int]) -> tuple[str, str] | None:
        """Takes the sample's output token ids so far (extending the previous call's); returns
        (the stop string matched, the text before it) once matched (again on later calls),
        else ``None``."""
        if self.hit is not None:
            return self.hit
        searched = max(len(self.detok.text) - self.hold, 0)
        text = self.detok.update(output_ids)
        hit = find_stop(text, self.stops, searched)
        if hit is not None:
            self.hit = (hit[1], text[:hit[0]])
        return self.hit


def stop_reason(seq, token: int, num_tokens: int, eos_ids: tuple[int, ...], max_model_len: int,
                decode: Callable[[Sequence[int]], str]) -> str | None:
    """Why ``seq`` ends if its token at ``num_tokens - 1`` is ``token``: ``"stop"``, ``"length"``,
    or ``None`` (see the module docstring for the order). On ``"stop"`` it records
    ``seq.stop_reason`` (``None`` for EOS, the token id, or the stop string) and, for a stop
    string, ``seq.stop_text`` (the output text to show). Calls for one sequence come with
    non-decreasing ``num_tokens`` and the tokens before ``num_tokens - 1`` already in
    ``seq.token_ids`` (the token itself need not be written yet)."""
    p = seq.params
    if token in eos_ids and not p.ignore_eos:
        seq.stop_reason = None
        return "stop"
    if token in p.stop_token_ids:
        seq.stop_reason = token
        return "stop"
    if p.stop:
        watch = seq.stop_watch
        if watch is None:
            watch = seq.stop_watch = StopWatch(decode, p.stop)
        ids = seq.token_ids[seq.num_prompt_tokens:num_tokens - 1]
        hit = watch.update([*ids, token])
        if hit is not None:
            s, before = hit
            seq.stop_reason = s
            seq.stop_text = before + s if p.include_stop_str_in_output else before
            return "stop"
    if num_tokens - seq.num_prompt_tokens >= p.max_tokens or num_tokens >= max_model_len:
        return "length"
    return None
