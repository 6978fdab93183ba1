"""The C++ matmul on quantized packed panels (kernels_cpu/small_matmul/quant.cc) and the
engine's use of it.

Truths: gguf-py's dequantize (llama.cpp's reference formats) and the int8 quantizer's
own scales, then numpy float64 products (the kernel within fp32 summation error of
them); the engine on the same quantized weights through XLA's dot (dequantized in the
step); the float32-dequantized default model.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from jaxserve.model.cpu import matmul as cpu_matmul
from jaxserve.model.loader.gguf_file import quantized_parts
from jaxserve.model.quant import QArray, quantize_matrix
from kernels_cpu.ragged_paged_attention import build

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU kernel")

GGUF_KINDS = {Q.Q8_0: "q8_0", Q.Q4_0: "q4_0", Q.Q4_1: "q4_1", Q.Q4_K: "q4_k"}


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if not build.available():
        pytest.skip("no C++ compiler: quantized weights stay on XLA's dot")


def _gguf(rows: int, cols: int, qtype: Q, seed: int) -> tuple[QArray, np.ndarray]:
    """A QArray of a GGUF type and its dequantization by gguf-py [rows, cols]."""
    rng = np.random.default_rng(seed)
    if qtype == Q.Q4_K:       # gguf-py cannot quantize to Q4_K: random valid blocks
        n = rows * cols // 256
        d = rng.uniform(1e-3, 2e-2, (n, 2)).astype(np.float16).view(np.uint8)
        raw = np.concatenate([d, rng.integers(0, 256, (n, 140), dtype=np.uint8)], axis=1)
        raw = raw.reshape(rows, -1)
    else:
        raw = quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.1, qtype)
    w = QArray(GGUF_KINDS[qtype], quantized_parts(raw, qtype, rows, cols), (rows, cols))
    return w, dequantize(raw, qtype).reshape(rows, cols)


def _int8(rows: int, cols: int, seed: int) -> tuple[QArray, np.ndarray]:
    m = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    w = quantize_matrix(m, "int8", jnp.float32)
    return w, w.parts["q"].astype(np.float32) * w.parts["scale"][:, None]


def _check(x: np.ndarray, got: np.ndarray, m: np.ndarray, what: str) -> None:
    ref = x.astype(np.float64) @ m.T.astype(np.float64)
    bound = 2e-6 * (np.abs(x).astype(np.float64) @ np.abs(m.T).astype(np.float64)) + 1e-30
    err = np.abs(got - ref)
    assert (err <= bound).all(), f"{what}: max err/bound {(err / bound).max():.3g}"


@pytest.mark.parametrize("qtype", [None, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K],
                         ids=["int8", "q8_0", "q4_0", "q4_1", "q4_k"])
def test_kernel_matches_the_reference_dequantization(qtype):
    """Every kept format, every row-group remainder: the panels hold exactly the
    reference's values, and x @ them matches float64 to fp32 summation error."""
    from kernels_cpu.small_matmul.quant import dequantize_panels, pack_quant, \
        quant_matmul_many
    N, K = 96, 512
    w, m = _int8(N, K, 1) if qtype is None else _gguf(N, K, qtype, 1)
    panels = pack_quant(w.kind, w.parts, w.shape)
    assert np.array_equal(dequantize_panels(*panels), m.T), w.kind
    assert np.array_equal(np.asarray(w.dequantize()), m)       # QArray agrees with gguf-py
    dev = tuple(jnp.asarray(a) for a in panels)
    rng = np.random.default_rng(2)
    for M in (1, 3, 8, 13):
        x = rng.standard_normal((M, K)).astype(np.float32)
        got = np.asarray(quant_matmul_many(jnp.asarray(x), [dev])[0])
        assert got.shape == (M, N) and got.dtype == np.float32
        _check(x, got, m, f"{w.kind} M={M}")


def _int8_acts_reference(x: np.ndarray, panels: tuple, narrow: bool = False
                         ) -> tuple[np.ndarray, np.ndarray]:
    """The int8-activation product of quantized panels in float64, from its definition
    (quant.cc): x quantized per 32 values (s = max|x| / L, xq = round-half-even(x / s),
    L = 127 for 4-bit panels and narrow 8-bit ones, else 32767), y = sum over blocks of
    scale * s * (q . xq) + offset * sum(x); and a bound on the float32 rounding of the
    kernel's order (|terms| summed)."""
    q, scale, offset = (np.asarray(a) for a in panels)
    P, _, C = q.shape
    M, K = x.shape
    levels = np.float32(127)
    if q.dtype == np.int8:                  # 8-bit values, no offset; x in 16 bits
        v = q.astype(np.float64)
        offset = np.zeros((P, K // 32, C))
        levels = np.float32(127 if narrow else 32767)
    else:
        v = np.stack([q & 15, q >> 4], axis=2).reshape(P, -1, C).astype(np.float64)   # [P, K, C]
    scale = np.repeat(np.asarray(scale), K // 32 // scale.shape[1], axis=1)     # per 32 rows
    xb = x.reshape(M, K // 32, 32)
    amax = np.abs(xb).max(axis=2)
    inv = np.divide(levels, amax, out=np.zeros_like(amax), where=amax > 0)
    xq = np.rint(xb * inv[..., None]).astype(np.float64)                           # [M, B, 32]
    s = (amax / levels).astype(np.float64)
    xsum = xb.astype(np.float64).sum(axis=2)
    vb = v.reshape(P, K // 32, 32, C)
    dots = np.einsum("mbk,pbkc->mpbc", xq, vb)                                      # exact ints
    sc, of = scale.astype(np.float64), offset.astype(np.float64)
    terms = sc[None] * s[:, None, :, None] * dots + of[None] * xsum[:, None, :, None]
    abs_terms = (np.abs(sc[None] * s[:, None, :, None] * dots)
                 + np.abs(of[None] * xsum[:, None, :, None]))
    y = terms.sum(axis=2).reshape(M, P * C)
    return y, 4e-6 * abs_terms.sum(axis=2).reshape(M, P * C) + 1e-30


# the integer path is in builds for an AVX2 (or AVX-512) CPU; the portable one keeps floats
needs_int_dot = pytest.mark.skipif(build.cpu_level() is None,
                                   reason="portable kernel build: no integer dot products")


@needs_int_dot
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=["q4_0", "q4_1", "q4_k"])
def test_int8_activations_match_their_definition(qtype):
    """--cpu-int8-activations: 4-bit panels at up to 8 rows multiply x quantized to int8
    per 32 values in integers. The kernel equals that definition to float32 rounding, lies
    within x's 8-bit rounding of the float product, and past 8 rows is the float path."""
    from kernels_cpu.small_matmul.quant import pack_quant, quant_matmul_many
    N, K = 96, 512
    w, m = _gguf(N, K, qtype, 7)
    panels = pack_quant(w.kind, w.parts, w.shape)
    dev = tuple(jnp.asarray(a) for a in panels)
    rng = np.random.default_rng(8)
    for M in (1, 2, 4, 5, 8):
        x = rng.standard_normal((M, K)).astype(np.float32)
        x[0, :32] = 0.0                                        # an all-zero block
        got = np.asarray(quant_matmul_many(jnp.asarray(x), [dev], int8_acts=True)[0])
        want, bound = _int8_acts_reference(x, panels)
        err = np.abs(got - want)
        assert (err <= bound).all(), f"{w.kind} M={M}: max err/bound {(err / bound).max():.3g}"
        exact = x.astype(np.float64) @ m.T.astype(np.float64)
        rel = np.abs(got - exact).max() / np.abs(exact).max()
        assert 1e-5 < rel < 3e-2, (w.kind, M, rel)             # x's rounding, not more
    x = rng.standard_normal((9, K)).astype(np.float32)
    got = np.asarray(quant_matmul_many(jnp.asarray(x), [dev], int8_acts=True)[0])
    _check(x, got, m, f"{w.kind} M=9 (float path)")


def _vnni() -> bool:
    try:
        return "avx512_vnni" in open("/proc/cpuinfo").read()
    except OSError:
        return False


@pytest.mark.parametrize("narrow", [False, True], ids=["x16", "x8"])
@pytest.mark.parametrize("kind", ["q8_0", "int8"])
def test_int8_activations_on_8_bit_weights(kind, narrow):
    """8-bit panels: at up to 8 rows the float path, int8 activations or not; past 8 rows,
    on an AVX-512 build on a CPU with AVX512-VNNI, the integer path (x quantized per 32
    values to 16 bits, or to 8 with narrow_acts), else the float path."""
    from kernels_cpu.small_matmul.quant import pack_quant, quant_matmul_many
    N, K = 96, 512
    w, m = _gguf(N, K, Q.Q8_0, 9) if kind == "q8_0" else _int8(N, K, 9)
    panels = pack_quant(w.kind, w.parts, w.shape)
    dev = tuple(jnp.asarray(a) for a in panels)
    rng = np.random.default_rng(10)
    x = rng.standard_normal((3, K)).astype(np.float32)
    _check(x, np.asarray(quant_matmul_many(jnp.asarray(x), [dev], int8_acts=True,
                                           narrow_acts=narrow)[0]), m, kind)
    integer = build.cpu_level() == "x86-64-v4" and _vnni()
    for M in (9, 13, 64):
        x = rng.standard_normal((M, K)).astype(np.float32) * rng.uniform(0.1, 10, (M, 1))
        x[1, 32:64] = 0.0                                      # an all-zero block
        x = x.astype(np.float32)
        got = np.asarray(quant_matmul_many(jnp.asarray(x), [dev], int8_acts=True,
                                           narrow_acts=narrow)[0])
        if not integer:
            _check(x, got, m, f"{kind} M={M} (float path)")
            continue
        want, bound = _int8_acts_reference(x, panels, narrow)
        err = np.abs(got - want)
        assert (err <= bound).all(), f"{kind} M={M}: max err/bound {(err / bound).max():.3g}"
        exact = x.astype(np.float64) @ m.T.astype(np.float64)
        rel = np.abs(got - exact).max() / np.abs(exact).max()
        low, high = (1e-3, 3e-2) if narrow else (3e-6, 1e-4)
        assert low < rel < high, (kind, M, rel)               # x's rounding, not more
        plain = np.asarray(quant_matmul_many(jnp.asarray(x), [dev])[0])
        _check(x, plain, m, f"{kind} M={M} without int8 activations")


def test_many_weights_one_call_and_threads_change_no_bit():
    from kernels_cpu.small_matmul.quant import pack_quant, quant_matmul_many
    ws = [_gguf(64, 256, Q.Q4_1, 3)[0], _gguf(32, 256, Q.Q4_1, 4)[0]]
    dev = [tuple(jnp.asarray(a) for a in pack_quant(w.kind, w.parts, w.shape)) for w in ws]
    x = jnp.asarray(np.random.default_rng(5).standard_normal((5, 256)), jnp.float32)
    both = quant_matmul_many(x, dev)
    for got, one in zip(both, dev):
        assert np.array_equal(np.asarray(got), np.asarray(quant_matmul_many(x, [one])[0]))
        single = quant_matmul_many(x, [one], num_threads=1)[0]
        assert np.array_equal(np.asarray(got), np.asarray(single))


def test_pack_weights_takes_quantized_projections_and_the_tied_head():
    """QArrays become QPackedWeight (layers and a tied head, whose panels the token
    lookup reads too); int8-activation QArrays stay for XLA's int8 dot; the linear gives
    the dequantized product; export gives the dequantized tensors."""
    from jaxserve.model.export import to_hf_state_dict
    from engine_utils import tiny_config, tiny_weights
    from jaxserve.model.params import quantize_weights
    cfg = tiny_config(tie_word_embeddings=True)
    w = tiny_weights(cfg)
    q = quantize_weights(cfg, w, "int8", embed=True)
    pw = cpu_matmul.pack_weights(q)
    for key in cpu_matmul.PACKED_KEYS:
        got = pw["layers"][0][key]
        assert isinstance(got, cpu_matmul.QPackedWeight), key
        want = np.asarray(q["layers"][0][key].dequantize()).T
        assert got.shape == want.shape and np.array_equal(got.unpacked(), want)
    assert isinstance(pw["head_packed"], cpu_matmul.QPackedWeight)
    assert isinstance(pw["embed"], cpu_matmul.PanelEmbedding)
    assert pw["embed"].head is pw["head_packed"] and pw["embed"].shape == q["embed"].shape
    ids = jnp.asarray([0, 1, 31, 32, 77, cfg.vocab_size - 1], jnp.int32)
    assert np.array_equal(np.asarray(pw["embed"][ids]), np.asarray(q["embed"][ids]))
    got, want = to_hf_state_dict(cfg, pw), to_hf_state_dict(cfg, {
        **q, "embed": q["embed"].dequantize(),
        "layers": [{k: v.dequantize().T if isinstance(v, QArray) else v
                    for k, v in layer.items()} for layer in q["layers"]]})
    assert got.keys() == want.keys()
    for name in want:
        assert np.array_equal(got[name], want[name]), name
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, cfg.hidden_size)),
                    jnp.float32)
    wq = pw["layers"][0]["wq"]
    _check(np.asarray(x), np.asarray(cpu_matmul.KERNEL_LINEAR(x, wq)), wq.unpacked().T, "wq")
    w8a8 = quantize_weights(cfg, w, "int8", embed=False, act="int8")
    assert isinstance(cpu_matmul.pack_weights(w8a8)["layers"][0]["wq"], QArray)


def _greedy(llm, prompts, max_tokens):
    from jaxserve import SamplingParams
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.warmup
def test_default_model_gguf_blocks_same_greedy_tokens(default_model):
    """SmolLM2-135M as it loads by default, from its own Q4_1 / Q8_0 blocks on the
    kernel (layers, the tied head and the token lookup reading the same panels), against
    the model dequantized to float32: the same greedy tokens, no recompiles, and at most
    120 MiB of weights as the kernel holds them (float32: 513 MiB)."""
    from jaxserve.frontend.llm import LLM
    from jaxserve.model.loader.load import load_model
    from jaxserve.model.quant import weight_bytes
    kept = load_model(None, skip_tokenizer=True)
    tok = default_model.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):",
             "Once upon a time, in a small village,", "List three primary colors:"]
    prompts = [tok(t).input_ids for t in texts]
    kw = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
              token_buckets=[1, 16])
    on = LLM.from_weights(kept.config, kept.weights, tok, cpu_matmul_kernel="auto", **kw)
    leaves = jax.tree_util.tree_leaves(
        on.engine.runner.weights, is_leaf=lambda v: isinstance(v, cpu_matmul.QPackedWeight))
    assert sum(isinstance(v, cpu_matmul.QPackedWeight) for v in leaves) == \
        7 * kept.config.num_layers + 2          # the head's panels: head_packed and embed
    assert isinstance(on.engine.runner.weights["embed"], cpu_matmul.PanelEmbedding)
    assert weight_bytes(on.engine.runner.weights) <= 120 * 2**20
    # the float32 reference on the float32 panels (equal to XLA's dot: test_cpu_matmul.py).
    # It only serves tokens, so it compiles just the shapes it runs, and it is
    # test_cpu_matmul.py's kernel engine, settings and all: the same step programs, which
    # the persistent compilation cache then holds for whichever of the two runs second
    from test_cpu_matmul import DEFAULT_MODEL_ENGINE
    ref = LLM.from_weights(default_model.config, default_model.weights, tok,
                           cpu_matmul_kernel="auto", warmup=False, **DEFAULT_MODEL_ENGINE)
    warm = on.num_compiles
    want = _greedy(ref, prompts, 24)
    assert _greedy(on, prompts, 24) == want
    assert _greedy(on, prompts[:1], 16) == _greedy(ref, prompts[:1], 16)   # 1-row bucket
    assert on.num_compiles == warm
    # --cpu-int8-activations: no longer bit-equal; the quality harness's bars on these
    # prompts (first 4 tokens equal on >= 90% of prompts, a common prefix >= 50%)
    # (a 4-token bucket: the batched decode steps run at <= 8 rows, where the option acts)
    acts = LLM.from_weights(kept.config, kept.weights, tok, cpu_matmul_kernel="auto",
                            cpu_int8_activations=True, **{**kw, "token_buckets": [1, 4, 16]})
    assert acts.engine.runner.cfg.linear.int8_activations
    warm = acts.num_compiles
    got = _greedy(acts, prompts, 24) + _greedy(acts, prompts[:1], 24)
    want = want + want[:1]
    first4 = sum(g[:4] == w[:4] for g, w in zip(got, want)) / len(want)
    prefix = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) / len(w)
              for g, w in zip(got, want)]
    assert first4 >= 0.9 and sum(prefix) / len(prefix) >= 0.5, (first4, prefix)
    assert acts.num_compiles == warm


def test_kernel_linear_picks_each_projections_activation_width():
    """KernelLinear with --cpu-int8-activations on an 8-bit weight at 16 rows: `many` (the
    grouped projections, a norm's output) takes x in 8 bits, a single projection in 16
    and an output head in float32, on a VNNI CPU; elsewhere all three are the float path."""
    from jaxserve.model.cpu.matmul import KERNEL_LINEAR, kernel_linear, pack_quantized
    w, m = _gguf(64, 256, Q.Q8_0, 11)
    packed = pack_quantized(w)
    lin = kernel_linear(True)
    x = jnp.asarray(np.random.default_rng(12).standard_normal((16, 256)), jnp.float32)
    plain = np.asarray(KERNEL_LINEAR(x, packed))
    head = np.asarray(lin.head(x, packed))
    one = np.asarray(lin(x, packed))
    grouped = np.asarray(lin.many(x, [packed])[0])
    assert np.array_equal(head, plain)
    exact = np.asarray(x, np.float64) @ m.T.astype(np.float64)
    err = {name: np.abs(y - exact).max() / np.abs(exact).max()
           for name, y in (("plain", plain), ("one", one), ("grouped", grouped))}
    if build.cpu_level() == "x86-64-v4" and _vnni():
        assert err["plain"] < 1e-6 and 3e-6 < err["one"] < 1e-4 and 1e-3 < err["grouped"] < 3e-2, err
    else:
        assert np.array_equal(one, plain) and np.array_equal(grouped, plain)
