"""From token ids to the text a client sees: incremental detokenization and held-back text.

`Choice` is one choice of a response (a sample of one prompt): text so far (decoded by the
shared `paged.request.stop_strings.Detokenizer`), how much was sent, its finish reason. Stop strings are
the engine's (``SamplingParams.stop``, `paged.request.stop_strings`): a match finishes the sample with
``"stop"`` and the engine's output carries the text cut before the stop string; while streaming,
the last ``len(longest stop) - 1`` characters are held back so a stop string split across steps
is never sent in part.
"""

from __future__ import annotations

from collections.abc import Sequence

from paged.request.stop_strings import Detokenizer

__all__ = ["CLIENT_REASONS", "Choice", "Detokenizer"]


# Engine finish reasons that a client sees as such; the others ("abort", "timeout") end the
# stream with an error.
CLIENT_REASONS = ("stop", "length")


class Choice:
    """One choice of a response: its text, what was sent, its finish reason.

    Args:
      index: ``choices[].index`` (prompt position x n + sample index).
      decode: the tokenizer's decode.
      stops: the request's stop strings (for the text held back while streaming).
      incremental: decode every step (streaming); otherwise the text is decoded once, in full,
        when the choice finishes.
    """

    __slots__ = ("index", "stops", "hold", "detok", "decode", "incremental", "text", "sent",
                 "num_tokens", "finish_reason", "started", "lps", "lp_sent", "token_ids",
                 "stop_reason")

    def __init__(self, index: int, decode, stops: tuple[str, ...] = (), incremental: bool = True):
        self.index, self.stops, self.decode = index, stops, decode
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.incremental = incremental
        self.detok = Detokenizer(decode) if self.incremental else None
        self.text, self.sent, self.num_tokens = "", 0, 0
        self.finish_reason: str | None = None  # "stop" | "length" | "abort" | "timeout"
        self.stop_reason: str | int | None = None  # vLLM's: the stop string or token id
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

    def update(self, token_ids: Sequence[int], engine_reason: str | None,
               stop_text: str | None = None) -> bool:
        """Takes the choice's token ids so far, the engine's finish reason and, when a stop
        string ended it, the engine's text (cut at the stop string); returns True if the choice
        just finished."""
        if self.done:
            return False
        self.num_tokens = len(token_ids)
        final = engine_reason is not None
        if stop_text is not None:
            self.text = stop_text
        elif self.incremental:
            self.text = self.detok.update(token_ids, final)
        elif final:
            self.text = self.decode(token_ids)
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
