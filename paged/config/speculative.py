"""``SpeculativeConfig``: how to speculate (a setting of ``EngineConfig``; the mechanism is
``paged.engine.spec_decode``)."""

from __future__ import annotations

import dataclasses

from paged.util import validate

METHODS = ("ngram", "draft")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How to speculate.

    Attributes:
      method: "ngram" (prompt lookup: no second model) or "draft" (a smaller model with the same
        vocabulary proposes k tokens autoregressively from its own KV cache; ``DraftModel``).
      model: the draft model for ``method="draft"``: a bundled name or a checkpoint directory.
      num_speculative_tokens: k, tokens proposed per decode per step (>= 1).
      ngram_min, ngram_max: n-gram lengths the n-gram proposer tries, longest first.
    """

    method: str = "ngram"
    model: str = "tiny-draft"
    num_speculative_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 4

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """A config from a command line: ``METHOD[:K]`` (``ngram:4``: n-gram proposals, k = 4;
        ``draft:3``: the bundled draft model, k = 3) or a JSON object of these fields, as vLLM's
        ``--speculative-config`` (``{"method": "draft", "model": "DIR",
        "num_speculative_tokens": 4}``).

        Raises:
          ValueError: neither form, a bad value; TypeError: an unknown JSON key (names the
            closest field).
        """
        text = text.strip()
        if text.startswith("{"):
            import json

            try:
                fields = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative={text!r:.80} is not valid JSON: {e}") from None
            if not isinstance(fields, dict):
                raise ValueError(f"speculative={text!r:.80} must be a JSON object")
            validate.known_keys("SpeculativeConfig", fields,
                                (f.name for f in dataclasses.fields(cls)))
            return cls(**fields)
        method, _, k = text.partition(":")
        if method not in METHODS or (k and not k.isdigit()):
            raise ValueError(f"speculative={text!r:.80} must be METHOD[:K] with METHOD one of "
                             f"{METHODS} (e.g. ngram:4) or a JSON object of SpeculativeConfig's "
                             f"fields")
        return cls(method=method, **({"num_speculative_tokens": int(k)} if k else {}))

    def __post_init__(self):
        validate.one_of("method", self.method, METHODS)
        validate.string("model", self.model)
        validate.integer("num_speculative_tokens", self.num_speculative_tokens, minimum=1,
                         maximum=64)
        validate.integer("ngram_min", self.ngram_min, minimum=1)
        validate.integer("ngram_max", self.ngram_max, minimum=1)
        if self.ngram_max < self.ngram_min:
            raise ValueError(f"ngram_max={self.ngram_max} must be >= ngram_min={self.ngram_min}")


__all__ = ["METHODS", "SpeculativeConfig"]
