"""The greedy head (kernels_cpu/greedy_head, model/cpu/greedy_head.py): a greedy row's token
from a float16 copy of the head plus a float32 recheck of the candidates equals the
argmax of the float32 logits the full path computes, and the engine takes that path
exactly for the steps whose rows need nothing but the argmax."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_utils import random_prompts
from jaxserve import SamplingParams as SP
from jaxserve.sampling import in_step
from jaxserve.sampling.metadata import build_sampling_metadata
from kernels_cpu.ragged_paged_attention import build


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if not build.available():
        pytest.skip("the CPU kernels did not build here")


def _full(x: jax.Array, w: jax.Array) -> np.ndarray:
    """The full path: the packed kernel's float32 logits, then jnp.argmax."""
    from kernels_cpu.small_matmul.kernel import small_matmul_many
    logits = small_matmul_many(x, [w], packed=True)[0]
    return np.asarray(jnp.argmax(logits, axis=-1))


def _screened(x: jax.Array, w: jax.Array) -> np.ndarray:
    from kernels_cpu.greedy_head.kernel import greedy_head, screen_copy
    w16, bound = screen_copy(w)
    return np.asarray(greedy_head(x, w16, bound, w))


def _head(e: np.ndarray) -> jax.Array:
    from kernels_cpu.small_matmul.kernel import pack_fast
    return pack_fast(jnp.asarray(e, jnp.float32), from_rows=True)


@pytest.mark.parametrize("D", [64, 576])
@pytest.mark.parametrize("M", [1, 3, 8, 13])
def test_equals_the_argmax_of_the_float32_logits(M, D):
    """Random heads and hidden rows at several scales, flat and peaked logits."""
    rng = np.random.default_rng(M * 1000 + D)
    for scale in (0.02, 0.3, 3.0):
        e = rng.standard_normal((2048, D)).astype(np.float32) * scale
        w = _head(e)
        for xs in (0.01, 1.0, 30.0):
            x = jnp.asarray(rng.standard_normal((M, D)).astype(np.float32) * xs)
            np.testing.assert_array_equal(_screened(x, w), _full(x, w))


def test_ties_and_near_ties_resolve_as_argmax():
    """Exact ties (duplicated vocabulary rows: the first index wins) and entries closer
    than float16 can tell apart (only the float32 recheck separates them)."""
    rng = np.random.default_rng(1)
    V, D = 1024, 96
    e = rng.standard_normal((V, D)).astype(np.float32) * 0.1
    x = rng.standard_normal((4, D)).astype(np.float32)
    best = int(np.argmax(x[0] @ e.T))
    e[900] = e[best]                   # an exact tie after the winner
    e[37] = e[best]                    # and one before it: 37 wins for row 0
    e[500] = e[best] * (1 + 1e-6)      # float16 copies equal, float32 logits differ
    e[501] = e[best] * (1 - 1e-6)
    w = _head(e)
    got = _screened(jnp.asarray(x), w)
    np.testing.assert_array_equal(got, _full(jnp.asarray(x), w))
    assert got[0] in (37, 500)


def test_degenerate_rows():
    """A zero row (all logits 0: index 0), a row with NaN (the first NaN logit, as
    jnp.argmax) and one with inf agree with the full path."""
    rng = np.random.default_rng(2)
    e = rng.standard_normal((512, 64)).astype(np.float32)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    x[0] = 0.0
    x[1, 5] = np.nan
    x[2, 7] = np.inf
    w = _head(e)
    np.testing.assert_array_equal(_screened(jnp.asarray(x), w), _full(jnp.asarray(x), w))
    assert _screened(jnp.asarray(x), w)[0] == 0


def test_bound_covers_the_float16_error():
    """|float32 logit - float16-weight logit| <= |x| * bound_v, entry by entry."""
    from kernels_cpu.greedy_head.kernel import screen_copy
    from kernels_cpu.small_matmul.kernel import unpack
    rng = np.random.default_rng(3)
    e = rng.standard_normal((1024, 128)).astype(np.float32) * 0.5
    w = _head(e)
    w16, bound = screen_copy(w)
    x = rng.standard_normal((8, 128)).astype(np.float32) * 4
    f = x.astype(np.float64) @ e.T.astype(np.float64)
    a = x.astype(np.float64) @ np.asarray(unpack(w16.astype(jnp.float32)), np.float64)
    slack = np.linalg.norm(x, axis=1, keepdims=True) * np.asarray(bound)[None, :]
    assert np.all(np.abs(f - a) <= slack)
    assert np.max(np.abs(f - a) / slack) > 0.01      # and is not vacuous


def test_no_copy_beyond_float16_range():
    from kernels_cpu.greedy_head.kernel import screen_copy
    e = np.ones((64, 32), np.float32)
    e[3, 4] = 1e5
    assert screen_copy(_head(e)) is None
    assert screen_copy(_head(np.ones((64, 32), np.float32))) is not None


def _inputs(params, mask=None) -> in_step.SamplingInputs:
    md = build_sampling_metadata(params, [0] * len(params), [(2,)] * len(params),
                                 len(params), 128)
    return in_step.SamplingInputs(
        md, np.arange(len(params), dtype=np.int32), np.ones(len(params), bool),
        np.bool_(any(p.logprobs is not None for p in params)), np.int32(0), None, mask)


def test_plain_greedy_flag():
    greedy = SP(temperature=0, max_tokens=4)
    assert bool(in_step.plain_greedy(_inputs([greedy, greedy])))
    for other in (SP(temperature=0.7), SP(temperature=0, logprobs=1),
                  SP(temperature=0, presence_penalty=0.5),
                  SP(temperature=0, repetition_penalty=1.2),
                  SP(temperature=0, logit_bias={5: 2.0}), SP(temperature=0, min_tokens=3)):
        assert not bool(in_step.plain_greedy(_inputs([greedy, other]))), other
    ones = np.full((2, 4), -1, np.int32)
    assert bool(in_step.plain_greedy(_inputs([greedy, greedy], ones)))
    some = ones.copy()
    some[1, 2] = 0x0F
    assert not bool(in_step.plain_greedy(_inputs([greedy, greedy], some)))


# --------------------------------------------------------------- whole engine
# every prompt fits the first step, so all requests decode in the same steps
ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=256,
              token_buckets=[1, 2, 4, 8, 256])


def _run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks
    return [[(list(c.token_ids), c.finish_reason) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("decode_steps", [1, 4])
@pytest.mark.slow
def test_engine_takes_the_path_only_for_plain_greedy_steps(tiny_llm_factory, monkeypatch,
                                                           decode_steps):
    """With the kernel's answer sabotaged (+1), greedy-only batches change and every
    batch with a row that needs the logits (sampling, logprobs, a penalty, min_tokens)
    does not; unsabotaged, greedy tokens equal --greedy-head off's."""
    from kernels_cpu.greedy_head import kernel as gk
    prompts = random_prompts(6, 128, 3, 20, seed=9)
    greedy = [SP(temperature=0, max_tokens=10, ignore_eos=True)] * len(prompts)
    head_off = tiny_llm_factory(**ENGINE, greedy_head="off", decode_steps=decode_steps)
    off = _run(head_off, prompts, greedy)
    assert _run(tiny_llm_factory(**ENGINE, decode_steps=decode_steps), prompts, greedy) == off
    real = gk.greedy_head
    monkeypatch.setattr(gk, "greedy_head",
                        lambda x, *a, **k: (real(x, *a, **k) + 1) % 128)
    # built after the sabotage, so its step calls the sabotaged kernel; private to this
    # test, so no other test sees it
    sabotaged = tiny_llm_factory(**ENGINE, decode_steps=decode_steps, fresh=True)
    assert _run(sabotaged, prompts, greedy) != off
    # (min_tokens = max_tokens suppresses EOS in every step: no ignore_eos, which would
    # leave nothing to suppress)
    for other in (SP(temperature=0.8, seed=4, max_tokens=10, ignore_eos=True),
                  SP(temperature=0, logprobs=2, max_tokens=10, ignore_eos=True),
                  SP(temperature=0, frequency_penalty=0.5, max_tokens=10, ignore_eos=True),
                  SP(temperature=0, min_tokens=10, max_tokens=10)):
        mixed = greedy[:-1] + [other]
        assert _run(sabotaged, prompts, mixed) == _run(head_off, prompts, mixed), other
