"""CPU decode throughput of a real pretrained model: paged KV vs the contiguous-KV baseline.

For each batch size B, one engine per KV layout (``kv_layout="paged"`` and ``"contiguous"``, the
same params, float32, greedy) holds B requests whose prompts are distinct corpus text
(`experiments.quality_tasks`); after the prefill and ``warmup_steps`` decode steps (which compile
the decode shape), each round times ``steps`` decode steps of every layout in turn, so the
layouts share the machine's state; tokens/s = B x steps / wall time. Reports the median over
rounds and the paged/contiguous ratio of the medians. ``evidence: constructed`` (a synthetic
batch of equal-length requests).
"""

from __future__ import annotations

import time

import numpy as np

from experiments import common
from experiments import quality_tasks as tasks


def check(c) -> None:
    common.check_positive(prompt_len=c.prompt_len, steps=c.steps, rounds=c.rounds,
                          max_model_len=c.max_model_len, block_size=c.block_size)
    for b in c.batch_sizes:
        common.check_positive(batch_size=b)
    need = c.prompt_len + c.warmup_steps + c.steps * c.rounds + 2
    if need > c.max_model_len:
        raise ValueError(f"max_model_len={c.max_model_len} < {need} (prompt + every decode step)")
    if set(c.layouts) - {"paged", "contiguous"} or not c.layouts:
        raise ValueError(f"layouts={c.layouts} must be 'paged' and/or 'contiguous'")


def _engine(c, layout, batch, config, params, prompts):
    from paged import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model=c.model, kv_layout=layout, max_num_seqs=batch,
                                 max_model_len=c.max_model_len, block_size=c.block_size,
                                 max_num_batched_tokens=max(256, batch)),
                    model_config=config, params=params)
    sp = SamplingParams(max_tokens=c.max_model_len - c.prompt_len - 1, temperature=0.0,
                        ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, sp)
    started: set[str] = set()
    while len(started) < batch:  # prefill (in chunks) until every request has its first token
        started |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    for _ in range(c.warmup_steps):  # decode steps at the full batch (compile the shape)
        engine.step()
    return engine


def _time_steps(engine, steps: int) -> float:
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return time.perf_counter() - t


def main(c, _) -> None:
    from paged.models.registry import load_any

    out_dir = common.output_dir(c, "real_model_decode")
    config, params, tok = load_any(c.model)
    corpus = tok.encode(tasks.corpus_text()[:200_000], add_bos=False)
    rows = []
    for batch in c.batch_sizes:
        prompts = tasks.chunks(corpus, c.prompt_len, batch)
        engines = {lay: _engine(c, lay, batch, config, params, prompts) for lay in c.layouts}
        times: dict[str, list[float]] = {lay: [] for lay in c.layouts}
        for _ in range(c.rounds):
            for lay, engine in engines.items():
                times[lay].append(_time_steps(engine, c.steps))
        row = {"batch_size": batch}
        for lay in c.layouts:
            tps = [batch * c.steps / t for t in times[lay]]
            row[lay] = {"tokens_per_s_median": float(np.median(tps)), "tokens_per_s": tps,
                        "step_ms_median": float(np.median(times[lay]) / c.steps * 1e3)}
        if len(c.layouts) == 2:
            row["paged_over_contiguous"] = (row["paged"]["tokens_per_s_median"]
                                            / row["contiguous"]["tokens_per_s_median"])
        rows.append(row)
        print(f"batch {batch:>3}: " + "  ".join(
            f"{lay} {row[lay]['tokens_per_s_median']:.1f} tok/s ({row[lay]['step_ms_median']:.1f} "
            f"ms/step)" for lay in c.layouts), flush=True)
        del engines
    payload = {"study": "real_model_decode", "evidence": "constructed", "model": c.model,
               "config": c.to_dict(), "provenance": common.provenance(), "rows": rows}
    print(f"wrote {common.write_json(out_dir / 'real_model_decode.json', payload)}")


if __name__ == "__main__":
    common.run("real_model_decode", main, check)
