"""`Llama`: a Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU) that serves from paged KV.

Written in Flax Linen because its params are a plain nested dict of arrays that jit, donation and
``np.savez`` handle directly, so the engine's step stays a pure function
``(params, cache, batch) -> (cache, outputs)``.

Two entry points share one set of params:

* ``model.apply(params, tokens, positions, k_pages, v_pages, md, logits_indices)`` -- serving: a
  ragged batch of new tokens (prefill chunks, decode steps, verification tokens), KV written into the
  stacked paged cache ``[L, K, num_pages, page_size, H]``, which is returned updated.
* ``model.apply(params, tokens, method="dense")`` -- training and the full-recompute reference.

Params hold one ``layers_{i}`` per block, or ``layers``: all blocks stacked on a leading axis
(`paged.models.scan_layers`), run by one ``jax.lax.scan`` so compile time does not grow with depth.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from paged.kv.groups import KVGroupLayout
from paged.models.attention import AttentionMetadata, PagedAttention
from paged.models.config import LlamaConfig
from paged.models.layers import RMSNorm, SwiGLU
from paged.models.scan_layers import STACKED


class DecoderBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    config: LlamaConfig
    sliding_window: int | None = None  # this layer's window (None: full attention)

    def setup(self):
        c = self.config
        self.attn_norm = RMSNorm(eps=c.norm_eps, dtype=c.compute_dtype)
        self.attn = PagedAttention(
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            rope_theta=c.rope_theta,
            dtype=c.compute_dtype,
            qkv_bias=c.qkv_bias,
            rope=c.rope if c.rope_scaling != "none" else None,
            sliding_window=self.sliding_window,
        )
        self.mlp_norm = RMSNorm(eps=c.norm_eps, dtype=c.compute_dtype)
        self.mlp = SwiGLU(ffn_dim=c.ffn_dim, dtype=c.compute_dtype)

    def __call__(self, x, positions, k_pages, v_pages, md, *, layer=None, attention_impl="xla"):
        h, k_pages, v_pages = self.attn(
            self.attn_norm(x), positions, k_pages, v_pages, md, layer=layer,
            attention_impl=attention_impl,
        )  # fmt: skip
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), k_pages, v_pages

    def dense(self, x, positions, *, attention_impl="jnp", kv_quant=None, sparse=None, layer=0):
        x = x + self.attn.dense(self.attn_norm(x), positions, attention_impl=attention_impl,
                                kv_quant=kv_quant, sparse=sparse, layer=layer)
        return x + self.mlp(self.mlp_norm(x))


def attention_mass(intermediates, num_layers: int) -> jax.Array:
    """Each layer's attention mass f32[L, S, K, pages_per_seq * page_size] from the
    ``"intermediates"`` of a paged forward run with ``md.mass_weight`` (``mutable=
    ["intermediates"]``): sown per layer, or stacked by the scanned layers."""
    if "attn_mass" in intermediates:
        return intermediates["attn_mass"][0]
    return jnp.stack([intermediates[f"layers_{i}"]["attn"]["attn_mass"][0]
                      for i in range(num_layers)])


class Llama(nn.Module):
    """Decoder-only LM. Params: ``embedding [V, D]``, ``layers_{i}`` (or ``layers``, stacked),
    ``final_norm``, and ``lm_head [D, V]`` when embeddings are untied."""

    config: LlamaConfig

    def setup(self):
        c = self.config
        self.embedding = self.param(
            "embedding", nn.initializers.normal(stddev=0.02), (c.vocab_size, c.d_model), jnp.float32
        )
        if self.has_variable("params", STACKED):  # stacked params (scan_layers): one scanned block
            self.stacked = self.get_variable("params", STACKED)
        else:
            self.stacked = None
            self.layers = [DecoderBlock(c, sliding_window=w) for w in c.layer_windows]
        self.final_norm = RMSNorm(eps=c.norm_eps, dtype=c.compute_dtype)
        if not c.tie_embeddings:
            self.lm_head = self.param(
                "lm_head",
                nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal"),
                (c.d_model, c.vocab_size),
                jnp.float32,
            )

    def _embed(self, tokens: jax.Array) -> jax.Array:
        return self.embedding[tokens].astype(self.config.compute_dtype)

    def _logits(self, x: jax.Array) -> jax.Array:  # [..., D] -> f32[..., V]
        x = self.final_norm(x)
        c = self.config
        if c.tie_embeddings:
            w = self.embedding.astype(c.compute_dtype)
            logits = jnp.einsum("...D,VD->...V", x, w, preferred_element_type=jnp.float32)
        else:
            w = self.lm_head.astype(c.compute_dtype)
            logits = jnp.einsum("...D,DV->...V", x, w, preferred_element_type=jnp.float32)
        return logits.astype(jnp.float32)

    def __call__(
        self,
        tokens: jax.Array,  # i32[T]
        positions: jax.Array,  # i32[T]
        k_pages: jax.Array,  # [L, K, num_pages, page_size, H]
        v_pages: jax.Array,  # [L, K, num_pages, page_size, H]
        md: AttentionMetadata,
        logits_indices: jax.Array | None = None,  # i32[S]
        *,
        attention_impl: str = "xla",
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Paged forward of one ragged step.

        Args:
          tokens: the step's new tokens, sequence after sequence (see `AttentionMetadata`).
          positions: each token's position in its sequence.
          k_pages: the stacked key cache; the returned array replaces it (donate it when jitting).
          v_pages: the stacked value cache; likewise.
          md: the step's metadata, shared by all layers; with KV-cache groups
            (``md.group_slots``) each layer reads its group's table and tensor slot.
          logits_indices: rows to compute logits for (e.g. each sequence's last token); all rows
            when None.
          attention_impl: ``impl`` of `pallas_kernels.ragged_paged_attention`
            ("auto" | "xla" | "pallas" | "interpret").

        Returns:
          ``(logits f32[S or T, V], k_pages, v_pages)`` with this step's K/V written.

        Raises:
          ValueError: cache shape does not match the config.
        """
        c = self.config
        # KV-cache groups: layer i uses tensor slot k of group g's table (paged.kv.groups)
        place = [(0, i) for i in range(c.num_layers)]
        if md.num_groups > 1:
            layout = KVGroupLayout.of(c.layer_windows)
            if layout.num_groups != md.num_groups:
                raise ValueError(f"the batch has {md.num_groups} KV-cache groups, the model "
                                 f"{layout.num_groups}")
            place = layout.placement
        want = (len(place) // md.num_groups, c.num_kv_heads, c.head_dim)
        got = (k_pages.shape[0], k_pages.shape[1], k_pages.shape[-1])
        if k_pages.ndim != 5 or got != want or v_pages.shape != k_pages.shape:
            raise ValueError(
                f"k_pages {k_pages.shape} / v_pages {v_pages.shape} must be "
                f"[num_layers={want[0]} (per KV-cache group), num_kv_heads={c.num_kv_heads}, num_pages, page_size, "
                f"head_dim={c.head_dim}]"
            )
        x = self._embed(tokens)
        if self.stacked is not None:
            x, k_pages, v_pages = self._scan(x, positions, k_pages, v_pages, md, attention_impl)
            if logits_indices is not None:
                x = x[logits_indices]
            return self._logits(x), k_pages, v_pages
        mds = [md] if md.num_groups == 1 else [md.for_group(g) for g in range(md.num_groups)]
        for block, (g, slot) in zip(self.layers, place, strict=True):
            # Stacked cache + layer index (not k_pages[i] ... .at[i].set) keeps the update in place.
            x, k_pages, v_pages = block(
                x, positions, k_pages, v_pages, mds[g], layer=slot, attention_impl=attention_impl
            )
        if logits_indices is not None:
            x = x[logits_indices]
        return self._logits(x), k_pages, v_pages

    def _unbound_block(self) -> DecoderBlock:
        # parent=None: a top-level module applied to each layer's slice of the stacked params
        return DecoderBlock(self.config, sliding_window=self.config.layer_windows[0], parent=None)

    def _scan(self, x, positions, k_pages, v_pages, md, attention_impl):
        """The stacked blocks as one scan; the cache is carried (updated in place) and each
        iteration writes and reads its layer's slot."""
        if md.num_groups > 1:
            raise ValueError(f"stacked layers take one KV-cache group, the batch has "
                             f"{md.num_groups}")
        block = self._unbound_block()
        mass = md.mass_weight is not None  # each layer's mass: a scan output, sown stacked

        def body(carry, xs):
            (x, k, v), (p, layer) = carry, xs
            args = ({"params": p}, x, positions, k, v, md)
            kw = dict(layer=layer, attention_impl=attention_impl)
            if not mass:
                return block.apply(*args, **kw), None
            out, state = block.apply(*args, **kw, mutable=["intermediates"])
            return out, state["intermediates"]["attn"]["attn_mass"][0]

        layers = jnp.arange(self.config.num_layers, dtype=jnp.int32)
        out, ys = jax.lax.scan(body, (x, k_pages, v_pages), (self.stacked, layers))
        if mass:
            self.sow("intermediates", "attn_mass", ys)
        return out

    def dense(
        self,
        tokens: jax.Array,  # i32[B, T]
        *,
        attention_impl: str = "jnp",
        kv_quant: tuple[str, str, int] | None = None,
        sparse: tuple | None = None,
    ) -> jax.Array:  # f32[B, T, V]
        """Full causal forward over contiguous sequences starting at position 0 (no cache).

        Args:
          tokens: token ids.
          attention_impl: "jnp" (plain float32 reference) or an ``impl`` of
            `pallas_kernels.flash_attention`.
          kv_quant: ``(kv_cache_dtype, scale_granularity, page_size)`` of a quantized cache to
            reproduce (quantize-on-write, see `PagedAttention.dense`); None: exact.
          sparse: ``(budget, page_size, dense_layers[, gqa[, recent]])``: every position
            attends as a sparse decode row would (`PagedAttention.dense`); None: every key.

        Returns:
          Next-token logits at every position.
        """
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1], dtype=jnp.int32), tokens.shape)
        x = self._embed(tokens)
        if self.stacked is not None:
            block = self._unbound_block()

            def body(x, xs):
                p, i = xs
                return block.apply({"params": p}, x, positions, method="dense",
                                   attention_impl=attention_impl, kv_quant=kv_quant,
                                   sparse=sparse, layer=i), None

            layers = jnp.arange(self.config.num_layers, dtype=jnp.int32)
            return self._logits(jax.lax.scan(body, x, (self.stacked, layers))[0])
        for i, layer in enumerate(self.layers):
            x = layer.dense(x, positions, attention_impl=attention_impl, kv_quant=kv_quant,
                            sparse=sparse, layer=i)
        return self._logits(x)
