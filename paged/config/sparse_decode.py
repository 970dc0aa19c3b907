"""``SparseDecodeConfig``: query-aware page selection at decode (Quest), a setting of
``EngineConfig(sparse_decode=...)``; the mechanism is ``pallas_kernels.page_select`` and
``paged.models.sparse_attention`` (docs/sparse-decode.md)."""

from __future__ import annotations

import dataclasses
import math

from paged.util import validate

MIN_PAGES = 2  # the first (sink) page and the last (open) page are always read
QUEST_DENSE_LAYERS = 2  # Quest's evaluation reads every page in its first two layers


@dataclasses.dataclass(frozen=True)
class SparseDecodeConfig:
    """How many pages a decode row reads. Give exactly one budget.

    Attributes:
      pages: read at most this many pages per sequence and KV head (>= 2: the first and the
        last page are always among them).
      tokens: the same budget in tokens: ``ceil(tokens / block_size)`` pages.
      fraction: in ``(0, 1]``: each sequence reads ``max(2, ceil(fraction * its pages))``.
      dense_layers: the first ``dense_layers`` layers read every page (no selection). The
        default, 2, is what Quest does (its evaluation skips selection in layers 0 and 1, whose
        attention is not sparse); 0 selects in every layer.
    """

    pages: int | None = None
    tokens: int | None = None
    fraction: float | None = None
    dense_layers: int = QUEST_DENSE_LAYERS

    def __post_init__(self):
        given = [n for n in ("pages", "tokens", "fraction") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"SparseDecodeConfig needs exactly one of pages, tokens, fraction; "
                             f"got {given or 'none'}")
        validate.integer("pages", self.pages, minimum=MIN_PAGES, maximum=validate.INT32_MAX,
                         allow_none=True)
        validate.integer("tokens", self.tokens, minimum=1, maximum=validate.INT32_MAX,
                         allow_none=True)
        validate.real("fraction", self.fraction, minimum=0, maximum=1, exclusive=True,
                      allow_none=True)
        validate.integer("dense_layers", self.dense_layers, minimum=0,
                         maximum=validate.INT32_MAX)

    @property
    def kind(self) -> str:
        return "fraction" if self.fraction is not None else "pages"

    def budget(self, block_size: int) -> float:
        """The budget as the selection takes it: pages (int) or a fraction of each sequence's
        pages."""
        if self.fraction is not None:
            return float(self.fraction)
        if self.tokens is not None:
            return max(MIN_PAGES, math.ceil(self.tokens / block_size))
        return int(self.pages)


__all__ = ["MIN_PAGES", "QUEST_DENSE_LAYERS", "SparseDecodeConfig"]
