"""From token ids to the text a client sees: incremental detokenization and stop strings.

`Detokenizer` decodes only a short window of the newest tokens per step, so a long stream costs
O(new tokens) per step rather than O(length): it keeps two offsets into the token ids and emits
``decode(ids[prefix:]) - decode(ids[prefix:read])``, holding text back while it ends in U+FFFD
(a multi-byte character whose last bytes have not arrived). At the end (``final=True``) the held
text is flushed as it decodes.

`Choice` is one choice of a response (a sample of one prompt): text so far, how much was sent,
stop strings (searched in the detokenized text; a match finishes the choice with ``"stop"`` and
the text is cut before the stop string, as OpenAI does), and while streaming, the last
``len(longest stop) - 1`` characters are held back so a stop string split across steps is never
sent in part.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_REPLACEMENT = "\ufffd"


class Detokenizer:
    """Incremental ``decode`` of a growing list of token ids (see the module docstring)."""

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


# Engine finish reasons that a client sees as such; the others ("abort", "timeout") end the
# stream with an error.
CLIENT_REASONS = ("stop", "length")


class Choice:
    """One choice of a response: its text, what was sent, its finish reason.

    Args:
      index: ``choices[].index`` (prompt position x n + sample index).
      decode: the tokenizer's decode.
      stops: stop strings.
      incremental: decode every step (streaming, or stop strings to watch); otherwise the text is
        decoded once, in full, when the choice finishes.
    """

    __slots__ = ("index", "stops", "hold", "detok", "decode", "incremental", "text", "sent",
                 "num_tokens", "finish_reason", "started", "lps", "lp_sent", "token_ids")

    def __init__(self, index: int, decode, stops: tuple[str, ...] = (), incremental: bool = True):
        self.index, self.stops, self.decode = index, stops, decode
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.incremental = incremental or bool(stops)
        self.detok = Detokenizer(decode) if self.incremental else None
        self.text, self.sent, self.num_tokens = "", 0, 0
        self.finish_reason: str | None = None  # "stop" | "length" | "abort" | "timeout"
        self.started = False  # the first chunk (chat: with the role) was sent
        self.lps: list | None = None  # per-token {token id: log-probability}, when asked for
        self.lp_sent = 0
        self.token_ids: list[int] = []

    def new_logprobs(self) -> list | None:
        """Log-probabilities of the tokens not reported yet (streaming), or None."""
        if self.lps is None:
            return None
        out = self.lps[self.lp_sent:self.num_tokens]
        self.lp_sent = self.num_tokens
        return out

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def update(self, token_ids: Sequence[int], engine_reason: str | None) -> bool:
        """Takes the choice's token ids so far and the engine's finish reason; returns True if
        the choice just finished (by the engine, or by a stop string found here)."""
        if self.done:
            return False
        self.num_tokens = len(token_ids)
        final = engine_reason is not None
        if not self.incremental:
            if final:
                self.text = self.decode(token_ids)
                self.finish_reason = engine_reason
            return final
        searched = max(len(self.text) - self.hold, 0)
        self.text = self.detok.update(token_ids, final)
        if self.stops:
            hit = min((p for p in (self.text.find(s, searched) for s in self.stops) if p >= 0),
                      default=-1)
            if hit >= 0:
                self.text = self.text[:hit]
                self.finish_reason = "stop"
                return True
        if final:
            self.finish_reason = engine_reason
        return final

    def delta(self) -> str:
        """Text not sent yet that may be sent now (all of it once finished)."""
        end = len(self.text) if self.done else len(self.text) - self.hold
        if end <= self.sent:
            return ""
        out = self.text[self.sent:end]
        self.sent = end
        return out
