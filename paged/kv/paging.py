"""Page-table conventions the host and the device share, in a module without JAX.

``NULL_PAGE`` (0) is the null page: page-table padding points at it and padded tokens write into it,
so it is never allocated to a sequence. ``next_pow2`` is the bucket rule for padded sizes (page
lists, batch rows, token counts), which bounds the number of compiled shapes.
"""

from __future__ import annotations

NULL_PAGE = 0


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
