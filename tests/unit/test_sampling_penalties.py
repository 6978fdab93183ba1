"""Penalties state and logit_bias vs transformers' logits processors / OpenAI's formula."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

from jaxserve.sampling.metadata import build_sampling_metadata
from jaxserve.sampling.params import SamplingParams as SP
from jaxserve.sampling.penalties import (apply_penalties, init_penalty_state, record_tokens,
                                         set_outputs, set_prompt)
from jaxserve.sampling.sampler import apply_bias

V, S, L = 64, 5, 16
rng = np.random.default_rng(0)
PROMPTS = [rng.integers(0, V, n).tolist() for n in (5, 12, 1)]
OUTPUTS = [rng.integers(0, V, n).tolist() for n in (7, 0, 20)]


def _padded(ids: list[int], width: int = L) -> jnp.ndarray:
    return jnp.asarray(ids + [0] * (width - len(ids)), jnp.int32)


def _state_for(prompts, outputs):
    """Slots 1.. hold the requests; outputs are recorded one step at a time."""
    st = init_penalty_state(S, V)
    st = jax.jit(record_tokens)(st, jnp.array([1, 2, 3]), jnp.array([4, 4, 4]), jnp.ones(3, bool))
    for slot, prompt in enumerate(prompts, start=1):          # zeroes the stale counts
        st = jax.jit(set_prompt)(st, slot, _padded(prompt), len(prompt))
    for step in range(max(map(len, outputs))):
        slots = jnp.arange(1, len(outputs) + 1)
        toks = jnp.asarray([o[step] if step < len(o) else 0 for o in outputs])
        valid = jnp.asarray([step < len(o) for o in outputs])
        st = jax.jit(record_tokens)(st, slots, toks, valid)
    return st


def test_state_counts_prompt_and_outputs():
    st = _state_for(PROMPTS, OUTPUTS)
    for slot, (prompt, out) in enumerate(zip(PROMPTS, OUTPUTS), start=1):
        np.testing.assert_array_equal(np.asarray(st.prompt_mask[slot]),
                                      np.bincount(prompt, minlength=V) > 0)
        np.testing.assert_array_equal(np.asarray(st.output_counts[slot]),
                                      np.bincount(out, minlength=V))
    restored = set_outputs(set_prompt(st, 1, _padded(PROMPTS[0]), len(PROMPTS[0])), 1,
                           _padded(OUTPUTS[0], 32), len(OUTPUTS[0]))
    np.testing.assert_array_equal(np.asarray(restored.output_counts),
                                  np.asarray(st.output_counts))


def test_penalties_match_transformers_and_openai_formula():
    params = [SP(repetition_penalty=1.3), SP(repetition_penalty=0.7, presence_penalty=0.5),
              SP(frequency_penalty=-0.4, presence_penalty=1.5, repetition_penalty=2.0)]
    st = _state_for(PROMPTS, OUTPUTS)
    logits = rng.standard_normal((3, V)).astype(np.float32) * 4
    logits[0, PROMPTS[0][0]] = 0.0
    md = build_sampling_metadata(params, [0] * 3, [()] * 3, 3, V)
    got = np.asarray(jax.jit(apply_penalties)(jnp.asarray(logits), st, jnp.arange(1, 4), md))
    for r, p in enumerate(params):
        ids = torch.tensor([PROMPTS[r] + OUTPUTS[r]])
        want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(
            ids, torch.tensor(logits[r:r + 1])).numpy()[0]
        counts = np.bincount(OUTPUTS[r], minlength=V)
        want = want - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        np.testing.assert_allclose(got[r], want, rtol=1e-6, atol=1e-6)


def test_no_penalty_rows_are_untouched():
    st = _state_for(PROMPTS, OUTPUTS)
    logits = jnp.asarray(rng.standard_normal((3, V)), jnp.float32)
    md = build_sampling_metadata([SP(), None, SP(presence_penalty=1.0)], [0] * 3, [()] * 3, 3, V)
    got = np.asarray(apply_penalties(logits, st, jnp.arange(1, 4), md))
    np.testing.assert_array_equal(got[:2], np.asarray(logits[:2]))
    assert not np.array_equal(got[2], np.asarray(logits[2]))


def test_logit_bias_matches_transformers_sequence_bias():
    bias = {3: 5.0, 17: -100.0, 63: 0.25}
    logits = rng.standard_normal((2, V)).astype(np.float32)
    md = build_sampling_metadata([SP(logit_bias=bias), None], [0, 0], [(), ()], 2, V)
    got = np.asarray(jax.jit(apply_bias)(jnp.asarray(logits), md))
    proc = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
    want = proc(torch.tensor([[0]]), torch.tensor(logits[:1])).numpy()[0]
    np.testing.assert_allclose(got[0], want, rtol=1e-6)
    np.testing.assert_array_equal(got[1], logits[1])
