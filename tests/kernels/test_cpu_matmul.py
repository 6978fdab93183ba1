"""The C++ small-M matmul (kernels_cpu/small_matmul) and its use in the engine.

Truths: numpy float64 products (the kernel within fp32 summation error of them), the
kernel itself with another thread count (bit-identical), and the engine with the kernel
switched off (greedy tokens identical on the default model and a tiny random one).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model.cpu import matmul as cpu_matmul
from kernels_cpu.ragged_paged_attention import build

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU kernel")


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if not build.available():
        pytest.skip("no C++ compiler: the kernel falls back to XLA's dot")


def _weight(K: int, N: int, transposed: bool, rng: np.random.Generator
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A random weight, and as [K, N] float64: itself and its magnitudes."""
    w = rng.standard_normal((N, K) if transposed else (K, N), np.float32)
    wk = (w.T if transposed else w).astype(np.float64)
    return w, wk, np.abs(wk)


def _check(M: int, K: int, N: int, transposed: bool, seed: int = 0,
           weight: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
           **kw) -> np.ndarray:
    from kernels_cpu.small_matmul.kernel import small_matmul
    rng = np.random.default_rng(seed + 1000 * M + K + N)
    x = rng.standard_normal((M, K), np.float32)
    w, wk, wk_abs = weight or _weight(K, N, transposed, rng)
    got = np.asarray(small_matmul(jnp.asarray(x), jnp.asarray(w), transposed=transposed, **kw))
    ref = x.astype(np.float64) @ wk
    # fp32 summation error grows with the magnitudes summed: bound it by |x| @ |w|
    bound = 1e-5 * (np.abs(x).astype(np.float64) @ wk_abs) + 1e-30
    assert got.shape == (M, N) and got.dtype == np.float32
    err = np.abs(got - ref)
    assert (err <= bound).all(), f"M={M} K={K} N={N} T={transposed}: max err/bound " \
                                 f"{(err / bound).max():.3g}"
    return got


MODEL_SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576)]


@pytest.mark.parametrize("M", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("K,N", MODEL_SHAPES)
def test_default_model_shapes(M, K, N):
    _check(M, K, N, transposed=False)


@pytest.fixture(scope="module")
def tied_head():
    """One random tied head for every row count: drawing it and widening it to float64
    (28M values) costs more than the products."""
    return _weight(576, 49152, True, np.random.default_rng(49152))


@pytest.mark.parametrize("M", [1, 3, 8, 16])
def test_tied_head_shape(M, tied_head):
    _check(M, 576, 49152, transposed=True, weight=tied_head)


@pytest.mark.parametrize("M", list(range(1, 17)))
@pytest.mark.parametrize("transposed", [False, True])
def test_every_row_count_odd_shapes(M, transposed):
    # K odd and not a vector multiple, N not a multiple of 16 (tails in both layouts),
    # and N wide enough for several column tiles and threads
    for K, N in [(7, 33), (577, 1000), (64, 17), (130, 2049)]:
        _check(M, K, N, transposed)


def test_degenerate_sizes():
    _check(1, 1, 1, False)
    _check(16, 3, 1, True)
    _check(2, 16, 16, False)


@pytest.mark.parametrize("transposed", [False, True])
def test_thread_count_changes_no_bit(transposed):
    a = _check(8, 576, 4096, transposed, num_threads=1)
    b = _check(8, 576, 4096, transposed, num_threads=0)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("M", [1, 3, 4, 8])
def test_many_equals_one_call_per_weight(M):
    """q/k/v and gate/up shapes (and odd ones) in one call: each output bit-identical to
    its own small_matmul call (same tiles, same order of sums), which _check bounds."""
    from kernels_cpu.small_matmul.kernel import small_matmul, small_matmul_many
    rng = np.random.default_rng(M)
    for K, Ns in [(576, (576, 192, 192)), (576, (1536, 1536)), (37, (5, 70, 16, 129))]:
        x = jnp.asarray(rng.standard_normal((M, K), np.float32))
        ws = [jnp.asarray(rng.standard_normal((K, n), np.float32)) for n in Ns]
        got = small_matmul_many(x, ws)
        assert [g.shape for g in got] == [(M, n) for n in Ns]
        for g, w in zip(got, ws):
            assert np.array_equal(np.asarray(g), np.asarray(small_matmul(x, w)))
        for n in Ns:
            _check(M, K, n, transposed=False)


def test_fits_only_decode_sized_float32():
    n = cpu_matmul.MAX_ROWS
    x_in, x_out = jnp.zeros((n, 8)), jnp.zeros((n + 1, 8))
    w = jnp.zeros((8, 4))
    assert cpu_matmul.fits(x_in, w)
    assert not cpu_matmul.fits(x_out, w)
    assert not cpu_matmul.fits(x_in.astype(jnp.bfloat16), w)
    assert not cpu_matmul.fits(jnp.zeros((2, n, 8)), w)


def test_enabled_only_on_cpu_unsharded_float32():
    assert cpu_matmul.enabled("auto", sharded=False, dtype=jnp.float32)
    assert not cpu_matmul.enabled("off", sharded=False, dtype=jnp.float32)
    assert not cpu_matmul.enabled("auto", sharded=True, dtype=jnp.float32)
    assert not cpu_matmul.enabled("auto", sharded=False, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="cpu_matmul_kernel"):
        cpu_matmul.enabled("on", sharded=False, dtype=jnp.float32)


def test_linear_and_head_take_the_kernel_when_asked():
    """A step program of <= MAX_ROWS rows holds the custom call; a larger one does not."""
    from jaxserve.model.linear import XLA_LINEAR
    kernel = cpu_matmul.KERNEL_LINEAR
    w, e = jnp.zeros((64, 32)), jnp.zeros((100, 64))
    for rows, expect in [(cpu_matmul.MAX_ROWS, True), (cpu_matmul.MAX_ROWS + 1, False), (64, False)]:
        x = jnp.zeros((rows, 64))
        for fn in (lambda x: kernel(x, w), lambda x: kernel.tied(x, e)):
            text = jax.jit(fn).lower(x).as_text()
            assert (build.MATMUL_TARGET in text) == expect, (rows, expect)
        assert build.MATMUL_TARGET not in jax.jit(lambda x: XLA_LINEAR(x, w)).lower(x).as_text()


def test_linear_many_one_call_when_the_kernel_fits():
    linear_many = cpu_matmul.KERNEL_LINEAR.many
    ws = [jnp.zeros((64, 32)), jnp.zeros((64, 8))]
    for rows, expect in [(1, 1), (cpu_matmul.MAX_ROWS, 1), (cpu_matmul.MAX_ROWS + 1, 0)]:
        text = jax.jit(lambda x: linear_many(x, ws)).lower(jnp.zeros((rows, 64))).as_text()
        assert text.count(build.MATMUL_MANY_TARGET) == expect, (rows, expect)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 64), np.float32))
    ws = [jnp.asarray(np.random.default_rng(i).standard_normal((64, n), np.float32))
          for i, n in enumerate((32, 8, 48))]
    for got, w in zip(linear_many(x, ws), ws):
        np.testing.assert_allclose(np.asarray(got), np.asarray(x @ w), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ packed weights

def _check_packed(M: int, K: int, Ns: tuple[int, ...], seed: int = 0, **kw) -> list:
    from kernels_cpu.small_matmul.kernel import pack, small_matmul_many
    rng = np.random.default_rng(seed + 1000 * M + K)
    x = rng.standard_normal((M, K), np.float32)
    ws = [rng.standard_normal((K, n), np.float32) for n in Ns]
    got = small_matmul_many(jnp.asarray(x), [pack(jnp.asarray(w)) for w in ws], packed=True,
                            **kw)
    outs = []
    for g, w in zip(got, ws):
        g = np.asarray(g)
        ref = x.astype(np.float64) @ w.astype(np.float64)
        bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(w.astype(np.float64))) + 1e-30
        assert g.shape == ref.shape and g.dtype == np.float32
        assert (np.abs(g - ref) <= bound).all(), f"M={M} K={K} N={w.shape[1]}"
        outs.append(g)
    return outs


@pytest.mark.parametrize("M", [1, 2, 5, 8, 9, 16, 31, 64, 200])
def test_packed_every_row_count(M):
    """Packed panels at decode and prefill row counts (row groups of 8 and their tails),
    the default model's shapes and odd K."""
    _check_packed(M, 576, (576, 192, 192))
    _check_packed(M, 1536, (576,))
    _check_packed(M, 37, (32, 96))


def test_packed_thread_count_changes_no_bit():
    a = _check_packed(8, 576, (4096,), num_threads=1)
    b = _check_packed(8, 576, (4096,), num_threads=0)
    assert np.array_equal(a[0], b[0])


def test_pack_layouts():
    from kernels_cpu.small_matmul.kernel import pack, pack_fast, unpack
    w = jnp.arange(5 * 64, dtype=jnp.float32).reshape(5, 64)
    p = pack(w)
    assert p.shape == (2, 5, 32)
    assert np.array_equal(np.asarray(p[1, 3]), np.asarray(w[3, 32:]))
    assert np.array_equal(np.asarray(unpack(p)), np.asarray(w))
    assert np.array_equal(np.asarray(pack_fast(w)), np.asarray(p))      # the C++ packing
    e = jnp.arange(64 * 5, dtype=jnp.float32).reshape(64, 5)     # a tied embedding [V, D]
    assert np.array_equal(np.asarray(pack_fast(e, from_rows=True)), np.asarray(pack(e.T)))


def test_pack_weights_tree():
    """Layer projections and the head packed; what the kernel cannot take (N not a
    multiple of 32, bfloat16, the MoE router) left alone; the caller's dicts unchanged."""
    from engine_utils import tiny_config, tiny_weights
    from jaxserve.model.cpu.matmul import PACKED_KEYS, PackedWeight, pack_weights
    w = tiny_weights(tiny_config())
    lm_head = w.pop("lm_head")                           # tied first
    w["layers"][0]["odd"] = jnp.zeros((64, 40), jnp.float32)
    w["layers"][1]["wq"] = w["layers"][1]["wq"].astype(jnp.bfloat16)
    before = {k: type(v) for k, v in w["layers"][0].items()}
    pw = pack_weights(w)
    assert {k: type(v) for k, v in w["layers"][0].items()} == before and "head_packed" not in w
    for key in PACKED_KEYS:
        got = pw["layers"][0][key]
        assert isinstance(got, PackedWeight) and got.shape == w["layers"][0][key].shape
        from kernels_cpu.small_matmul.kernel import unpack
        assert np.array_equal(np.asarray(unpack(got.panels)), np.asarray(w["layers"][0][key]))
    assert not isinstance(pw["layers"][0]["odd"], PackedWeight)
    assert not isinstance(pw["layers"][1]["wq"], PackedWeight)
    assert isinstance(pw["head_packed"], PackedWeight)
    assert pw["head_packed"].shape == w["embed"].T.shape and pw["embed"] is w["embed"]
    untied = pack_weights({**w, "lm_head": lm_head})
    assert isinstance(untied["lm_head"], PackedWeight) and "head_packed" not in untied


def test_export_unpacks_packed_weights():
    """The engine's packed weights export to the same HF tensors as the unpacked ones
    (benchmarks/harness.py writes its F32 GGUF from the running engine's weights)."""
    from engine_utils import tiny_config, tiny_weights
    from jaxserve.model.cpu.matmul import pack_weights
    from jaxserve.model.export import to_hf_state_dict
    cfg = tiny_config()
    w = tiny_weights(cfg)
    want = to_hf_state_dict(cfg, w)
    got = to_hf_state_dict(cfg, pack_weights(w))
    assert got.keys() == want.keys()
    for name in want:
        assert np.array_equal(got[name], want[name]), name


def test_linear_on_packed_weights_any_rows():
    """A packed weight takes the kernel at every row count (prefill too), same values."""
    from jaxserve.model.cpu.matmul import PackedWeight
    linear = cpu_matmul.KERNEL_LINEAR
    linear_many = linear.many
    from kernels_cpu.small_matmul.kernel import pack
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((64, 96), np.float32))
    u = jnp.asarray(rng.standard_normal((64, 32), np.float32))
    pw, pu = PackedWeight(pack(w)), PackedWeight(pack(u))
    for rows in (1, 7, 64, 300):
        x = jnp.asarray(rng.standard_normal((rows, 64), np.float32))
        text = jax.jit(lambda x: linear(x, pw)).lower(x).as_text()
        assert text.count(build.MATMUL_MANY_TARGET) == 1 and " dot(" not in text
        np.testing.assert_allclose(np.asarray(linear(x, pw)), np.asarray(x @ w),
                                   rtol=1e-5, atol=1e-4)
        _, b = linear_many(x, [pw, pu])
        np.testing.assert_allclose(np.asarray(b), np.asarray(x @ u), rtol=1e-5, atol=1e-4)


# ------------------------------------------------------------------ in the engine

def _greedy(llm, prompts, max_tokens):
    from jaxserve import SamplingParams
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _engines(cfg, weights, tok, **kw):
    from jaxserve.frontend.llm import LLM
    on = LLM.from_weights(cfg, weights, tok, cpu_matmul_kernel="auto", **kw)
    # the reference only serves tokens: it compiles the step shapes it runs, never all
    off = LLM.from_weights(cfg, weights, tok, cpu_matmul_kernel="off",
                           **{**kw, "warmup": False})
    assert on.engine.cpu_matmul and on.engine.runner.cfg.cpu_matmul
    assert not off.engine.cpu_matmul and not off.engine.runner.cfg.cpu_matmul
    # the kernel's engine holds its layer projections and head packed; the other none
    leaves = lambda llm: jax.tree_util.tree_leaves(         # noqa: E731
        llm.engine.runner.weights, is_leaf=lambda v: isinstance(v, cpu_matmul.PackedWeight))
    packed = [v for v in leaves(on) if isinstance(v, cpu_matmul.PackedWeight)]
    assert len(packed) == 7 * cfg.num_layers + 1
    assert not any(isinstance(v, cpu_matmul.PackedWeight) for v in leaves(off))
    return on, off


@pytest.mark.warmup
def test_tiny_engine_same_tokens_and_no_recompiles():
    from engine_utils import random_prompts, tiny_config, tiny_tokenizer, tiny_weights
    from jaxserve import SamplingParams
    cfg = tiny_config()
    on, off = _engines(cfg, tiny_weights(cfg), tiny_tokenizer(), max_model_len=128,
                       max_num_seqs=16, max_num_batched_tokens=64, token_buckets=[1, 4, 16, 64])
    prompts = random_prompts(12, 128, 3, 60, seed=5)
    warm = on.num_compiles
    assert _greedy(on, prompts, 12) == _greedy(off, prompts, 12)
    for n, mt in [(1, 6), (3, 5), (16, 4)]:      # every decode bucket, sampled too
        on.generate([{"prompt_token_ids": p} for p in random_prompts(n, 128, 3, 40, seed=n)],
                    SamplingParams(max_tokens=mt, temperature=0.8, seed=1, ignore_eos=True),
                    use_tqdm=False)
    assert on.num_compiles == warm


# a 32-token bucket holds the 4 prompts' prefill (past 8 rows: the kernel's half-panel
# path), and the decodes run at 4 rows and at 1 (its register row groups)
DEFAULT_MODEL_ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                            token_buckets=[1, 4, 32])


def test_default_model_same_greedy_tokens(default_model):
    """SmolLM2-135M (fp32): the kernel's summation order differs from XLA's dot (fp32
    rounding), yet 24 greedy tokens of each prompt are identical with and without it."""
    lm = default_model
    tok = lm.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):",
             "Once upon a time, in a small village,", "List three primary colors:"]
    prompts = [tok(t).input_ids for t in texts]
    # test_cpu_quant_matmul.py's float32 reference is this kernel engine with these very
    # settings: the two build the same step programs, so the second to run loads them
    # from the persistent compilation cache instead of compiling them again
    on, off = _engines(lm.config, lm.weights, tok, **DEFAULT_MODEL_ENGINE)
    want = _greedy(off, prompts, 24)
    assert _greedy(on, prompts, 24) == want
    # the kernel's 1-row bucket against the same reference tokens: greedy tokens do not
    # depend on the batch a prompt runs in, and XLA's dot at one row (a matrix-vector
    # product, unoptimised in the suite) would cost more to compile and run than the rest
    assert _greedy(on, prompts[:1], 24) == want[:1]
