"""Attention over paged KV: `AttentionMetadata`, the `PagedAttention` layer, a dense causal reference.

`PagedAttention` is a drop-in Linen layer: it owns the q/k/v/o projections, applies RoPE at the given
positions, scatters the new tokens' K/V into its layer's pages (`kv_cache.write_layer`) and attends with
`pallas_kernels.ragged_paged_attention`. Its `dense` method runs the same parameters over contiguous
`[B, T]` batches (training, and the no-cache reference the paged path is tested against).

Dimension letters: B batch, T tokens (query rows), S keys, D d_model, N query heads, K kv heads,
G queries per kv head, H head_dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from paged.kv import cache as kv_cache
from paged.models.layers import _fan_in_init, apply_rope


@flax.struct.dataclass
class AttentionMetadata:
    """Where the step's tokens go and what each sequence attends to (same for every layer).

    ``num_tokens`` and ``max_num_seqs`` are the bucketed (padded) sizes. Padding tokens write into
    ``kv_cache.NULL_PAGE``; padding sequences have ``kv_lens == 0`` and an empty q range.
    """

    slot_mapping: jax.Array  # i32[num_tokens]: page * page_size + offset of each new token
    page_indices: jax.Array  # i32[max_num_seqs, pages_per_seq]
    kv_lens: jax.Array  # i32[max_num_seqs]: tokens in the cache after this step's writes
    cu_q_lens: jax.Array  # i32[max_num_seqs + 1]: sequence i owns q rows cu[i]:cu[i+1]
    num_seqs: jax.Array  # i32[1]: real sequences (the rest are padding)
    # Decode-only steps with shared prefixes (paged.step.cascade_plan): i32[G, max_num_seqs + 1], row
    # g = (shared tokens, member sequences..., -1 padded); token row i is sequence i's decode.
    cascade: jax.Array | None = None
    # KV-cache groups (paged.kv.groups): i32[G - 1, num_tokens], the slot mappings of
    # groups 1 .. G-1 (``slot_mapping`` is group 0's); ``page_indices`` then interleaves the
    # groups' tables, i32[max_num_seqs, G * pages_per_seq] with group g's in columns g::G.
    # None: one table for every layer.
    group_slots: jax.Array | None = None
    # Sparse decode (paged.models.sparse_attention.SparseDecode): decode rows read the pages
    # Quest selects. None: every row reads all its pages.
    sparse: object | None = None
    # Packed (int4 / int2, KIVI) pages: the step's open-page and closing indices
    # (paged.models.kivi_attention.KiviMeta). None: any other cache.
    kivi: object | None = None
    # KV policies scoring by attention (paged.kv.mass): f32[num_tokens], each query row's weight
    # in the attention mass each layer then reports (sown as "intermediates"/"attn_mass",
    # f32[max_num_seqs, K, pages_per_seq * page_size]). None: no mass computed.
    mass_weight: jax.Array | None = None
    # Per-layer budgets of a KV policy (PyramidKV): i32[L, max_num_seqs, 2], layer l of sequence
    # i does not see its slots [lo, hi). None: every layer sees every slot.
    kv_holes: jax.Array | None = None

    @property
    def num_groups(self) -> int:
        return 1 if self.group_slots is None else self.group_slots.shape[0] + 1

    def for_group(self, g: int) -> AttentionMetadata:
        """The metadata group ``g``'s layers read: its table and slot mapping alone."""
        n = self.num_groups
        return self.replace(
            slot_mapping=self.slot_mapping if g == 0 else self.group_slots[g - 1],
            page_indices=self.page_indices[:, g::n], group_slots=None)


def build_metadata(
    kv_lens: Sequence[int],
    q_lens: Sequence[int],
    page_tables: Sequence[Sequence[int]],
    *,
    page_size: int,
    num_tokens: int | None = None,
    max_num_seqs: int | None = None,
    pages_per_seq: int | None = None,
) -> tuple[AttentionMetadata, np.ndarray, np.ndarray]:
    """Builds padded metadata on the host (numpy) for one ragged step.

    Sequence ``i`` has ``kv_lens[i]`` tokens after this step, the last ``q_lens[i]`` of which are new
    (so their positions are ``kv_lens[i] - q_lens[i] ... kv_lens[i] - 1``), stored in the pages
    ``page_tables[i]`` in order. The new tokens are laid out sequence after sequence.

    Args:
      kv_lens: tokens per sequence, including the new ones.
      q_lens: new tokens per sequence, ``1 <= q_lens[i] <= kv_lens[i]``.
      page_tables: physical pages of each sequence, at least ``ceil(kv_lens[i] / page_size)``.
      page_size: tokens per page.
      num_tokens: padded token count (default: exactly ``sum(q_lens)``).
      max_num_seqs: padded sequence count (default: ``len(kv_lens)``).
      pages_per_seq: page-table width (default: the longest table).

    Returns:
      ``(metadata, positions i32[num_tokens], logits_indices i32[max_num_seqs])``: numpy arrays;
      ``logits_indices`` is the row of each sequence's last new token (0 for padding sequences).

    Raises:
      ValueError: inconsistent lengths, too few pages, a page equal to ``NULL_PAGE``, or padded
        sizes smaller than the content.
    """
    n = len(kv_lens)
    if len(q_lens) != n or len(page_tables) != n:
        raise ValueError(f"{len(kv_lens)=}, {len(q_lens)=}, {len(page_tables)=} must be equal")
    total = int(sum(q_lens))
    num_tokens = total if num_tokens is None else num_tokens
    max_num_seqs = n if max_num_seqs is None else max_num_seqs
    widest = max((len(t) for t in page_tables), default=1)
    pages_per_seq = max(widest, 1) if pages_per_seq is None else pages_per_seq
    if num_tokens < total or max_num_seqs < n or pages_per_seq < widest:
        raise ValueError(
            f"padded sizes {num_tokens=}, {max_num_seqs=}, {pages_per_seq=} are smaller than the "
            f"content ({total} tokens, {n} sequences, {widest} pages)"
        )
    slot_mapping = np.full((num_tokens,), kv_cache.NULL_PAGE * page_size, np.int32)
    positions = np.zeros((num_tokens,), np.int32)
    page_indices = np.full((max_num_seqs, pages_per_seq), kv_cache.NULL_PAGE, np.int32)
    kv = np.zeros((max_num_seqs,), np.int32)
    cu = np.full((max_num_seqs + 1,), total, np.int32)
    logits_indices = np.zeros((max_num_seqs,), np.int32)
    row = 0
    for i, (kv_len, q_len, table) in enumerate(zip(kv_lens, q_lens, page_tables, strict=True)):
        if not 1 <= q_len <= kv_len:
            raise ValueError(f"sequence {i}: q_len={q_len} must be in [1, kv_len={kv_len}]")
        if len(table) * page_size < kv_len:
            raise ValueError(f"sequence {i}: {len(table)} pages of {page_size} < kv_len={kv_len}")
        if kv_cache.NULL_PAGE in list(table)[: -(-kv_len // page_size)]:
            raise ValueError(f"sequence {i}: page table {list(table)} uses NULL_PAGE")
        pos = np.arange(kv_len - q_len, kv_len)
        table = np.asarray(table, np.int32)
        slot_mapping[row : row + q_len] = table[pos // page_size] * page_size + pos % page_size
        positions[row : row + q_len] = pos
        page_indices[i, : len(table)] = table
        kv[i] = kv_len
        cu[i] = row
        row += q_len
        logits_indices[i] = row - 1
    md = AttentionMetadata(
        slot_mapping=slot_mapping,
        page_indices=page_indices,
        kv_lens=kv,
        cu_q_lens=cu,
        num_seqs=np.array([n], np.int32),
    )
    return md, positions, logits_indices


def causal_attention(
    q: jax.Array,  # [B, T, N, H]
    k: jax.Array,  # [B, S, K, H]
    v: jax.Array,  # [B, S, K, H]
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    mask: jax.Array | None = None,  # bool[B, K, T, S]: keys each query may also see
) -> jax.Array:  # [B, T, N, H]
    """Dense causal GQA attention in float32; the T queries are the last T of the S keys (with
    ``sliding_window`` W, the query at position p sees keys ``[p - W + 1, p]`` only; with
    ``mask``, only the keys it marks, per KV head)."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, t, kh, n // kh, h)
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k.astype(jnp.float32)) * sm_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    pos = (jnp.arange(t) + (s - t))[:, None]
    allowed = jnp.arange(s)[None, :] <= pos  # [T, S]
    if sliding_window is not None:
        allowed &= jnp.arange(s)[None, :] > pos - sliding_window
    if mask is not None:
        allowed = allowed[None, None, None] & mask[:, :, None]
    logits = jnp.where(allowed, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v.astype(jnp.float32))
    return out.reshape(b, t, n, h).astype(q.dtype)


class PagedAttention(nn.Module):
    """Multi-head GQA attention with RoPE that reads and writes one layer's KV pages.

    Attributes:
      num_heads: query heads N.
      num_kv_heads: key/value heads K (``N % K == 0``).
      head_dim: H.
      rope_theta: RoPE base.
      soft_cap: optional logit soft cap passed to the kernel.
      dtype: compute dtype.
      qkv_bias: add biases ``q_bias [N, H]``, ``k_bias [K, H]``, ``v_bias [K, H]`` to the
        projections (Qwen2); off by default (no such params).
      rope: ``LlamaConfig.rope`` (scaled RoPE, see `paged.models.layers.rope_inv_freq`); replaces
        ``rope_theta`` when given.
      sliding_window: W of a sliding-window layer (the token at position p attends to
        ``[p - W + 1, p]``); None for full causal attention.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    soft_cap: float | None = None
    dtype: jnp.dtype = jnp.float32
    qkv_bias: bool = False
    rope: tuple | None = None
    sliding_window: int | None = None

    @nn.compact
    def _weights(self, d_model: int) -> tuple[jax.Array, ...]:
        # The one compact method: both paths call it, so they share the same four weights.
        n, k, h = self.num_heads, self.num_kv_heads, self.head_dim
        if n % k:
            raise ValueError(f"num_heads={n} must be a multiple of num_kv_heads={k}")
        wq = self.param("q_proj", _fan_in_init(0, (1, 2)), (d_model, n, h), jnp.float32)
        wk = self.param("k_proj", _fan_in_init(0, (1, 2)), (d_model, k, h), jnp.float32)
        wv = self.param("v_proj", _fan_in_init(0, (1, 2)), (d_model, k, h), jnp.float32)
        wo = self.param("o_proj", _fan_in_init((0, 1), 2), (n, h, d_model), jnp.float32)
        if self.qkv_bias:
            zeros = nn.initializers.zeros
            bq = self.param("q_bias", zeros, (n, h), jnp.float32)
            bk = self.param("k_bias", zeros, (k, h), jnp.float32)
            bv = self.param("v_bias", zeros, (k, h), jnp.float32)
        else:
            bq = bk = bv = jnp.zeros((), jnp.float32)
        return tuple(w.astype(self.dtype) for w in (wq, wk, wv, wo, bq, bk, bv))

    def project(self, x: jax.Array, positions: jax.Array):
        """``(q [B, T, N, H], k, v [B, T, K, H], wo [N, H, D])`` of a dense batch ``x [B, T, D]``:
        queries and keys after RoPE, as attention uses them (a study of what attention reads)."""
        return self._qkv(x, positions, "BTD")

    def _qkv(self, x: jax.Array, positions: jax.Array, spec: str):
        # spec: "TD" (ragged rows) or "BTD" (dense batches). The bias is added before RoPE (HF).
        wq, wk, wv, wo, bq, bk, bv = self._weights(x.shape[-1])
        x = x.astype(self.dtype)
        lead = spec[:-1]
        q = jnp.einsum(f"{spec},DNH->{lead}NH", x, wq)
        k = jnp.einsum(f"{spec},DKH->{lead}KH", x, wk)
        v = jnp.einsum(f"{spec},DKH->{lead}KH", x, wv)
        if self.qkv_bias:
            q, k, v = q + bq, k + bk, v + bv
        q = apply_rope(q, positions, theta=self.rope_theta, rope=self.rope)
        k = apply_rope(k, positions, theta=self.rope_theta, rope=self.rope)
        return q, k, v, wo

    def __call__(
        self,
        x: jax.Array,  # [T, D] normalized hidden states of the step's tokens
        positions: jax.Array,  # i32[T]
        k_pages: jax.Array,  # [K, num_pages, page_size, H], or [L, K, ...] with `layer`
        v_pages: jax.Array,  # same shape as k_pages
        md: AttentionMetadata,
        *,
        layer: int | None = None,
        attention_impl: str = "xla",
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Paged path: writes the new K/V, attends over each sequence's pages.

        Args:
          x: inputs of the q/k/v projections, one row per new token (ragged batch, see
            `AttentionMetadata`).
          positions: position of each token in its sequence (RoPE).
          k_pages: this layer's key pages (``layer=None``), or the whole stacked cache with
            ``layer`` naming this layer's slot; a ``pallas_kernels.quant.QuantizedPages`` for a
            quantized cache (the write quantizes, the kernel dequantizes). The returned array replaces it (donate it in a
            jitted step).
          v_pages: the value pages, likewise.
          md: the step's metadata.
          layer: index into a stacked cache. Prefer it to slicing ``k_pages[i]`` out and setting it
            back: the slice-write-set pattern makes XLA copy the pages every step, while writing
            into the stacked array keeps the donated cache updated in place.
          attention_impl: ``impl`` of `pallas_kernels.ragged_paged_attention`.

        Returns:
          ``(out [T, D], new_k_pages, new_v_pages)``, pages with the same shape as given. Padding
          rows of ``out`` are not meaningful.
        """
        import pallas_kernels as pk  # the dense (training) path does not need the kernels
        from pallas_kernels import quant

        q, k, v, wo = self._qkv(x, positions, "TD")
        if md.kivi is not None:  # packed pages: quantize-on-fill (paged.models.kivi_attention)
            from paged.models import kivi_attention

            out, k_pages, v_pages = kivi_attention.attend(
                q, k, v, k_pages, v_pages, md, layer=layer, sm_scale=self.head_dim**-0.5,
                soft_cap=self.soft_cap, impl=attention_impl)
            return jnp.einsum("TNH,NHD->TD", out.astype(self.dtype), wo), k_pages, v_pages
        k_pages, v_pages = kv_cache.write_layer(k_pages, v_pages, k, v, md.slot_mapping,
                                                layer=layer)
        # With `layer`, the kernel reads the stacked cache directly: slicing k_pages[layer] here
        # would copy the whole layer every step.
        q = q.astype(quant.query_dtype(k_pages, self.dtype))
        if md.sparse is not None:
            from paged.models import sparse_attention

            out = sparse_attention.attend(q, k_pages, v_pages, md, layer=layer,
                                          sm_scale=self.head_dim**-0.5, soft_cap=self.soft_cap,
                                          impl=attention_impl)
        elif md.cascade is not None and self.sliding_window is None:
            out = self._cascade(q, k_pages, v_pages, md, layer, attention_impl)
        else:
            extra = {} if md.mass_weight is None else {"mass_weight": md.mass_weight}
            if md.kv_holes is not None:
                extra["kv_holes"] = md.kv_holes[0 if layer is None else layer]
            out = pk.ragged_paged_attention(
                q, k_pages, v_pages, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
                sm_scale=self.head_dim**-0.5, soft_cap=self.soft_cap, impl=attention_impl,
                layer=layer, sliding_window=self.sliding_window, **extra,
            )  # fmt: skip
            if md.mass_weight is not None:
                out, mass = out
                self.sow("intermediates", "attn_mass", mass)
        out = jnp.einsum("TNH,NHD->TD", out.astype(self.dtype), wo)
        return out, k_pages, v_pages

    def _cascade(self, q, k_pages, v_pages, md, layer, attention_impl):
        """A decode-only step's attention with shared prefixes read once per group
        (``pallas_kernels.cascade_paged_attention``): token row ``i < num_seqs`` is sequence
        ``i``'s one query; padding rows get some sequence's output (not meaningful)."""
        import pallas_kernels as pk

        num_tokens, num_seqs = q.shape[0], md.kv_lens.shape[0]
        rows = jnp.minimum(jnp.arange(num_seqs), num_tokens - 1)
        out = pk.cascade_paged_attention(
            q[rows], k_pages, v_pages, md.kv_lens, md.page_indices, md.cascade[:, 1:],
            md.cascade[:, 0], sm_scale=self.head_dim**-0.5, soft_cap=self.soft_cap,
            impl=attention_impl, layer=layer,
        )  # fmt: skip
        return out[jnp.minimum(jnp.arange(num_tokens), num_seqs - 1)]

    def dense(
        self,
        x: jax.Array,  # [B, T, D]
        positions: jax.Array,  # i32[B, T]
        *,
        attention_impl: str = "jnp",
        kv_quant: tuple[str, str, int] | None = None,
        sparse: tuple | None = None,
        layer=0,
    ) -> jax.Array:  # [B, T, D]
        """Dense causal path over contiguous sequences (training; the no-cache reference).

        Args:
          x: inputs of the q/k/v projections.
          positions: position of each token (RoPE); causality is by row order, not by position.
          attention_impl: "jnp" (`causal_attention`, float32) or an ``impl`` of
            `pallas_kernels.flash_attention` ("xla", "pallas", ...).
          kv_quant: ``(kv_cache_dtype, scale_granularity, page_size)``: K and V are replaced by
            what a quantized paged cache reads back (`pallas_kernels.quant.fake_quantize_sequence`),
            the reference of a quantized engine. For "int4" / "int2" (KIVI pages; the
            granularity is ignored) each query reads the pages full at its position quantized
            and its open page exact (`pallas_kernels.kivi.dense_on_fill`). None: exact.
          sparse: ``(budget, page_size, dense_layers[, gqa[, recent]])`` of sparse decode: every
            position reads the pages its decode row would select
            (`page_select.dense_selection_mask`), unless ``layer < dense_layers`` ("jnp" only). ``layer``: this layer's index (maybe traced).

        Returns:
          Attention output projected back to ``D``.
        """
        q, k, v, wo = self._qkv(x, positions, "BTD")
        if kv_quant is not None and kv_quant[0] in ("int4", "int2"):
            return jnp.einsum("BTNH,NHD->BTD", self._dense_kivi(q, k, v, kv_quant), wo)
        if kv_quant is not None:
            from pallas_kernels import quant

            name, granularity, page_size = kv_quant
            dtype = quant.storage_dtype(name)
            k, v = (quant.fake_quantize_sequence(t, dtype, granularity, page_size).astype(t.dtype)
                    for t in (k, v))
        sm_scale = self.head_dim**-0.5
        mask = None
        if sparse is not None:
            from pallas_kernels import page_select

            if attention_impl != "jnp" or kv_quant is not None or self.sliding_window is not None:
                raise ValueError("sparse (the Quest reference) takes attention_impl='jnp', no "
                                 "kv_quant and no sliding window")
            budget, page_size, dense_layers, *rest = sparse
            gqa, recent = (tuple(rest) + ("max", 0)[len(rest):])[:2]
            mask = page_select.dense_selection_mask(q, k, page_size=page_size, budget=budget,
                                                    gqa=gqa, recent=recent)
            mask = mask | (layer < dense_layers)
        if attention_impl == "jnp":
            out = causal_attention(q, k, v, sm_scale=sm_scale, soft_cap=self.soft_cap,
                                   sliding_window=self.sliding_window, mask=mask)
        elif self.sliding_window is not None:
            raise ValueError(f"attention_impl={attention_impl!r} (flash_attention) has no sliding "
                             "window; the dense path of a sliding layer takes 'jnp'")
        else:
            import pallas_kernels as pk

            out = pk.flash_attention(
                q, k, v, causal=True, sm_scale=sm_scale, soft_cap=self.soft_cap, impl=attention_impl
            )
        return jnp.einsum("BTNH,NHD->BTD", out.astype(self.dtype), wo)

    def _dense_kivi(self, q, k, v, kv_quant):  # [B, T, N, H] x 3 -> [B, T, N, H]
        from pallas_kernels import kivi, packed

        if self.sliding_window is not None:
            raise ValueError("kv_quant int4/int2 (KIVI) has no sliding-window reference")
        name, _, page_size = kv_quant
        out = kivi.dense_on_fill(q, k, v, bits=packed.bits_of(name), page_size=page_size,
                                 sm_scale=self.head_dim**-0.5, soft_cap=self.soft_cap)
        return out.astype(self.dtype)
