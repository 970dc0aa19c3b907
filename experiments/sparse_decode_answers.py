"""Teacher-forced needle answers under Quest selection (`experiments.sparse_decode`'s
``answers`` part): many needles per arm at the cost of one prompt forward each.

Per needle prompt: the prompt runs dense (as the engine's prefill), its keys and values kept
per layer; then for each arm of ``config.arms`` the reference answer ("The secret code of
{name} is {number}.") is fed after the prompt, every answer row attending as a decode row of
that arm would (``page_select.dense_selection_mask`` over the prompt's and the answer's post-RoPE
keys, layers ``>= dense_layers``; the answer's first token comes from the prompt's last row,
dense in every arm, as the engine's prefill). Recorded per arm and needle: whether every answer
token is the argmax (the greedy decode then writes exactly the reference sentence), whether every
digit token is, the first wrong token, the digits' log-probability, and the pages each answer
row reads per KV head (selecting layers; real queries and keys: the byte count of ``gqa="union"``
depends on them) against the pages it holds.
"""

from __future__ import annotations

import functools
import time

import numpy as np


def _layer_fns(config):
    """``(prompt, answer)``: jitted one-layer functions of a ``DecoderBlock``'s params."""
    import jax
    import jax.numpy as jnp

    from paged.models.attention import causal_attention
    from paged.models.llama import DecoderBlock
    from pallas_kernels import page_select

    block = DecoderBlock(config, sliding_window=None, parent=None)

    def kv(m, x, pos):
        _, k, v, _ = m.attn.project(m.attn_norm(x), pos)
        return k, v

    @jax.jit
    def prompt(p, x, pos):  # -> (next x, k, v) of the prompt, dense
        k, v = block.apply({"params": p}, x, pos, method=kv)
        return block.apply({"params": p}, x, pos, method="dense"), k, v

    @functools.partial(jax.jit, static_argnames=("sparse",))
    def answer(p, x, pos, kp, vp, sparse):  # sparse: (budget, page, gqa, recent) or None
        def body(m, x, pos, kp, vp):
            q, k, v, wo = m.attn.project(m.attn_norm(x), pos)
            keys, values = jnp.concatenate([kp, k], 1), jnp.concatenate([vp, v], 1)
            mask, pages = None, jnp.zeros(q.shape[:1] + (k.shape[2], q.shape[1]), jnp.int32)
            if sparse is not None:
                budget, page, gqa, recent = sparse
                mask = page_select.dense_selection_mask(q, keys, page_size=page, budget=budget,
                                                        gqa=gqa, recent=recent)  # [B, K, A, T]
                padded = jnp.pad(mask, ((0, 0),) * 3 + ((0, (-mask.shape[-1]) % page),))
                pages = padded.reshape(*mask.shape[:3], -1, page).any(-1).sum(-1)  # [B, K, A]
            out = causal_attention(q, keys, values, sm_scale=m.attn.head_dim**-0.5, mask=mask,
                                   soft_cap=m.attn.soft_cap)
            x = x + jnp.einsum("BTNH,NHD->BTD", out.astype(x.dtype), wo)
            return x + m.mlp(m.mlp_norm(x)), pages

        return block.apply({"params": p}, x, pos, kp, vp, method=body)

    return prompt, answer


def _log_probs(config, params, x):  # x [B, T, D] -> f32[B, T, V]
    import jax
    import jax.numpy as jnp

    from paged.models.layers import RMSNorm

    p = params["params"]
    xn = RMSNorm(eps=config.norm_eps).apply({"params": p["final_norm"]}, x)
    w = p["embedding"].T if config.tie_embeddings else p["lm_head"]
    return jax.nn.log_softmax(jnp.einsum("BTD,DV->BTV", xn, w), -1)


def answer_rows(c, rows: list, save, parse_arm) -> list[dict]:
    """Appends one row per (length, arm) to ``rows`` (``save()`` after each length)."""
    import jax
    import jax.numpy as jnp

    from experiments import quality_tasks as tasks
    from paged.models.registry import load_any

    config, params, tok = load_any(c.model)
    corpus = tok.encode(tasks.corpus_text(), add_bos=False)
    prompt_fn, answer_fn = _layer_fns(config)
    layers = params["params"]["layers"]
    embed = params["params"]["embedding"]
    arms = [(a, *parse_arm(a)) for a in c.arms]
    for length in c.answer_lengths:
        t0 = time.perf_counter()
        per_arm = {a: [] for a, *_ in arms}
        needle_list = [n for d in c.retrieval_depths
                       for n in tasks.needles(tok, corpus, length, d, c.needles_per_cell, c.seed)]
        for n in needle_list:
            ref = tok.encode(f"The secret code of {n.name} is {n.answer}.", add_bos=False)
            digits = [j for j, t in enumerate(ref) if tok.decode([t]).strip().isdigit()]
            x = embed[jnp.asarray([n.prompt_ids])]
            pos = jnp.arange(len(n.prompt_ids), dtype=jnp.int32)[None]
            cache = []
            for i in range(config.num_layers):
                x, k, v = prompt_fn(jax.tree.map(lambda a, i=i: a[i], layers), x, pos)
                cache.append((k, v))
            first = np.asarray(_log_probs(config, params, x[:, -1:])[0, 0])
            apos = jnp.arange(len(n.prompt_ids), len(n.prompt_ids) + len(ref) - 1,
                              dtype=jnp.int32)[None]
            held = -(-(np.asarray(apos[0]) + 1) // c.block_size)  # pages each answer row holds
            for arm, f, dense_layers, gqa, recent in arms:
                xa, read = embed[jnp.asarray([ref[:-1]])], []
                for i in range(config.num_layers):
                    sparse = (None if f is None or i < dense_layers
                              else (f, c.block_size, gqa, recent))
                    xa, pages = answer_fn(jax.tree.map(lambda a, i=i: a[i], layers), xa, apos,
                                          *cache[i], sparse)
                    if sparse is not None:
                        read.append(np.asarray(pages[0]))  # [K, A]
                lp = np.concatenate([first[None], np.asarray(_log_probs(config, params, xa)[0])])
                ok = lp.argmax(-1) == np.asarray(ref)
                per_arm[arm].append({
                    "depth": n.depth, "answer": n.answer, "sentence": bool(ok.all()),
                    "digits": bool(ok[digits].all()),
                    "first_wrong": int(np.argmin(ok)) if not ok.all() else None,
                    "digit_logprob": float(sum(lp[j, ref[j]] for j in digits)),
                    "pages_read": float(np.mean(read)) if read else None,
                    "pages_held": float(np.mean(held))})
        for arm, f, dense_layers, gqa, recent in arms:
            got = per_arm[arm]
            depth = {str(d): float(np.mean([g["digits"] for g in got if g["depth"] == d]))
                     for d in c.retrieval_depths}
            read = [g["pages_read"] for g in got if g["pages_read"] is not None]
            rows.append({"length": length, "arm": arm, "fraction": f,
                         "dense_layers": None if f is None else dense_layers,
                         "gqa": None if f is None else gqa,
                         "recent_pages": None if f is None else recent, "needles": len(got),
                         "digits": float(np.mean([g["digits"] for g in got])),
                         "sentence": float(np.mean([g["sentence"] for g in got])),
                         "digits_by_depth": depth,
                         "pages_read_per_row_head": float(np.mean(read)) if read else None,
                         "pages_held_per_row": float(np.mean([g["pages_held"] for g in got])),
                         "per_needle": got, "seconds": time.perf_counter() - t0})
            r = rows[-1]
            print(f"answers {length} {arm}: digits {r['digits']:.3f} sentence "
                  f"{r['sentence']:.3f} pages read {r['pages_read_per_row_head']} of "
                  f"{r['pages_held_per_row']:.1f}", flush=True)
        save()
    return rows


__all__ = ["answer_rows"]
