"""``SparseDecodeConfig``: query-aware page selection at decode (Quest), a setting of
``EngineConfig(sparse_decode=...)``; the mechanism is ``pallas_kernels.page_select`` and
``paged.models.sparse_attention`` (docs/sparse-decode.md)."""

from __future__ import annotations

import dataclasses
import math

from paged.util import validate

MIN_PAGES = 2  # the first (sink) page and the last (open) page are always read
QUEST_DENSE_LAYERS = 2  # Quest's evaluation reads every page in its first two layers
GQA_MODES = ("max", "rank", "union")  # as pallas_kernels.page_select.GQA_MODES


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
      gqa: how a KV head's query group (GQA) picks its one page list. ``"max"`` (default): a
        page's score is the largest of the group's query heads' bounds; the group reads the
        budget. ``"rank"``: each query head ranks the pages by its own bound (Quest scores per
        query head) and the group reads the budget, the best-ranked page of any head first
        (the heads' lists merged round-robin; same bytes as ``"max"``). ``"union"``: every page
        some query head ranks within its own budget (Quest's per-query-head selection, each
        page read once for the group): up to ``G * (budget - 2) + 2`` pages, more bytes read.
      recent_pages: the last ``recent_pages`` pages before the open page are always read, like
        the first and the open page, counted inside the budget (a row keeps
        ``min(recent_pages, budget - 2)`` of them, the top pages by bound fill the rest), so the
        pages read do not grow. Default 0: only the first and the open page are forced.
    """

    pages: int | None = None
    tokens: int | None = None
    fraction: float | None = None
    dense_layers: int = QUEST_DENSE_LAYERS
    gqa: str = "max"
    recent_pages: int = 0

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
        validate.integer("recent_pages", self.recent_pages, minimum=0,
                         maximum=validate.INT32_MAX)
        if self.gqa not in GQA_MODES:
            raise ValueError(f"SparseDecodeConfig.gqa={self.gqa!r} must be one of {GQA_MODES}")

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


__all__ = ["GQA_MODES", "MIN_PAGES", "QUEST_DENSE_LAYERS", "SparseDecodeConfig"]
