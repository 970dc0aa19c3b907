"""How fast `paged.models.load_checkpoint` reads a checkpoint, against a plain read of its files.

Writes a synthetic Llama checkpoint (random bfloat16 weights, sharded safetensors + index, sized
to ``target_bytes``) into a temporary directory, then per round times, each with a cold and then a
warm page cache:

* ``read``: the shards read into memory with ``readinto`` (the disk-bound floor of any loader);
* ``load_<dtype>``: ``load_checkpoint(dir, dtype=...)``: headers checked, every tensor read,
  converted to the Flax layout (transposes, reshapes) and to ``dtype``.

"Cold" means each shard was ``fsync``ed and dropped from the page cache with
``posix_fadvise(POSIX_FADV_DONTNEED)`` just before; whether that worked is measured, not assumed:
``resident_before`` is the fraction of the files' pages in the page cache right before the run
(``mincore``; 0 = read from disk, 1 = all cached). A virtual disk may still be cached by the host
below the VM, which no guest can see: read the cold MB/s as an upper bound of the disk's speed.

  python -m experiments.checkpoint_load_bench [--config=experiments/configs/checkpoint_load_bench.py:smoke]

Writes ``checkpoint_load_bench.json`` to ``config.output_dir`` (default
``results/checkpoint_load_bench/<UTC timestamp>/``).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from experiments import common


def layer_params(c) -> int:
    head_dim = c.d_model // c.num_heads
    attn = 2 * c.d_model * c.num_heads * head_dim + 2 * c.d_model * c.num_kv_heads * head_dim
    return attn + 3 * c.d_model * c.ffn_dim + 2 * c.d_model


def hf_config(c) -> dict:
    """A LlamaForCausalLM config.json whose bf16 tensors add up to about ``target_bytes``."""
    embed = 2 * c.vocab_size * c.d_model + c.d_model  # embedding, lm_head, final norm
    layers = max(1, round((c.target_bytes / 2 - embed) / layer_params(c)))
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": c.d_model, "intermediate_size": c.ffn_dim, "num_hidden_layers": layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.d_model // c.num_heads, "vocab_size": c.vocab_size,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }


def write_checkpoint(directory: Path, c) -> dict:
    """Writes config.json, ``num_shards`` safetensors shards and their index; returns the config."""
    import jax.numpy as jnp
    from safetensors.numpy import save_file

    from paged.models.hf import weight_map
    from paged.models.hf_config import read_hf_config

    cfg = hf_config(c)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    shapes = {k: v[0] for k, v in weight_map(read_hf_config(directory)).items()}
    names = list(shapes)
    rng = np.random.default_rng(c.seed)
    per = -(-len(names) // c.num_shards)
    index, total = {}, 0
    for s in range(c.num_shards):
        file = f"model-{s + 1:05d}-of-{c.num_shards:05d}.safetensors"
        tensors = {}
        for name in names[s * per:(s + 1) * per]:
            w = rng.standard_normal(shapes[name], dtype=np.float32) * 0.02
            tensors[name] = w.astype(jnp.bfloat16)
            index[name] = file
            total += tensors[name].nbytes
        save_file(tensors, str(directory / file))
        del tensors
    meta = {"metadata": {"total_size": total}, "weight_map": index}
    (directory / "model.safetensors.index.json").write_text(json.dumps(meta))
    return cfg


def shards(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def drop_cache(paths: list[Path]) -> None:
    """fsync each file and ask the kernel to drop its clean pages from the page cache."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(paths: list[Path]) -> float | None:
    """Fraction of the files' pages in the page cache (Linux ``mincore``; None if unavailable)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    resident = pages = 0
    for path in paths:
        size = path.stat().st_size
        n = -(-size // page)
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            vec = (ctypes.c_ubyte * n)()
            ok = libc.mincore(addr, size, vec) == 0
            libc.munmap(addr, size)
        finally:
            os.close(fd)
        if not ok:
            return None
        resident += sum(v & 1 for v in vec)
        pages += n
    return resident / max(pages, 1)


def plain_read(paths: list[Path]) -> int:
    total = 0
    for path in paths:
        buf = bytearray(path.stat().st_size)
        with open(path, "rb", buffering=0) as f:
            view, got = memoryview(buf), 0
            while got < len(buf):
                got += f.readinto(view[got:])
        total += len(buf)
        del buf
    return total


def timed(fn, paths: list[Path], cache: str) -> dict:
    if cache == "cold":
        drop_cache(paths)
    before = resident_fraction(paths)
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    nbytes = sum(p.stat().st_size for p in paths)
    return {"cache": cache, "resident_before": before, "seconds": seconds,
            "mb_per_s": nbytes / 1e6 / seconds}


def check(c):
    common.check_positive(target_bytes=c.target_bytes, rounds=c.rounds, num_shards=c.num_shards,
                          min_free_factor=c.min_free_factor)
    if c.d_model % c.num_heads or c.num_heads % c.num_kv_heads:
        raise ValueError(f"d_model={c.d_model}, num_heads={c.num_heads}, num_kv_heads="
                         f"{c.num_kv_heads}: heads must divide d_model and kv heads divide heads")
    for dtype in c.load_dtypes:
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"load_dtypes: {dtype!r} must be float32, bfloat16 or float16")
    base = Path(c.tmp_dir or tempfile.gettempdir())
    free = shutil.disk_usage(base).free
    if free < c.min_free_factor * c.target_bytes:
        raise ValueError(f"tmp_dir={str(base)!r} has {free / 2**30:.1f} GiB free < "
                         f"min_free_factor={c.min_free_factor} x target_bytes={c.target_bytes}")
    return base


def main(c, base: Path) -> None:
    from paged.models import load_checkpoint

    out_dir = common.output_dir(c, "checkpoint_load_bench")
    directory = Path(tempfile.mkdtemp(prefix="ckpt_bench_", dir=base))
    try:
        t0 = time.perf_counter()
        cfg = write_checkpoint(directory, c)
        write_s = time.perf_counter() - t0
        paths = shards(directory)
        nbytes = sum(p.stat().st_size for p in paths)
        print(f"wrote {nbytes / 1e6:.0f} MB in {len(paths)} shards ({cfg['num_hidden_layers']} "
              f"layers) to {directory} in {write_s:.1f} s", flush=True)
        methods = {"read": lambda: plain_read(paths)}
        for dtype in c.load_dtypes:
            methods[f"load_{dtype}"] = lambda dtype=dtype: load_checkpoint(directory, dtype=dtype)
        runs = []
        progress = common.Progress(c.rounds * len(methods) * 2, "checkpoint_load_bench",
                                   unit="load")
        for r in range(c.rounds):
            for name, fn in methods.items():
                for cache in ("cold", "warm"):
                    row = {"round": r, "method": name, **timed(fn, paths, cache)}
                    runs.append(row)
                    progress.set(len(runs), method=name, cache=cache)
                    print(f"round {r} {name:15s} {cache}: {row['seconds']:7.3f} s "
                          f"{row['mb_per_s']:8.1f} MB/s (resident before: "
                          f"{row['resident_before']})", flush=True)
        progress.close()
        summary = {}
        for name in methods:
            for cache in ("cold", "warm"):
                rows = [x for x in runs if x["method"] == name and x["cache"] == cache]
                summary[f"{name}_{cache}"] = {
                    "median_seconds": statistics.median(x["seconds"] for x in rows),
                    "median_mb_per_s": statistics.median(x["mb_per_s"] for x in rows),
                    "max_resident_before": max((x["resident_before"] or 0.0) for x in rows),
                }
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    out = out_dir / "checkpoint_load_bench.json"
    common.write_result(out, {
        "study": "checkpoint_load_bench", "evidence": "constructed",
        "note": "synthetic random bf16 weights; cold = fsync + POSIX_FADV_DONTNEED before the run, "
                "resident_before measured with mincore",
        "config": c.to_dict(), "hf_config": cfg, "checkpoint_bytes": nbytes,
        "num_files": len(paths), "write_seconds": write_s, "runs": runs, "summary": summary,
        "load_average_after": os.getloadavg(), "cpu_count": os.cpu_count(),
        "provenance": common.provenance(),
    })
    for key, s in summary.items():
        print(f"{key:22s} median {s['median_seconds']:7.3f} s {s['median_mb_per_s']:8.1f} MB/s")
    print(f"wrote {out}")


if __name__ == "__main__":
    common.run("checkpoint_load_bench", main, check)
