"""``SpeculativeConfig``: how to speculate (a setting of ``EngineConfig``; the mechanism is
``paged.spec_decode``)."""

from __future__ import annotations

import dataclasses

from paged import validate

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
