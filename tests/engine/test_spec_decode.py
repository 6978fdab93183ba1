"""Speculative decoding (n-gram): configuration, proposals, verification mask, and the
engine end to end. The truth: hand-computed proposals and masks, and the same engine
without speculation (greedy outputs must be token-identical)."""
from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np
import pytest

from engine_utils import random_prompts, tiny_config, tiny_tokenizer, tiny_weights
from spec_utils import spy_chunked_prefills, use_oracle
from jaxserve import SamplingParams
from jaxserve.config import ConfigError, EngineArgs
from jaxserve.cli_args import add_cli_args, engine_args_from_cli
from jaxserve.frontend.llm import LLM
from jaxserve.spec_decode.config import SpeculativeConfig
from jaxserve.spec_decode.ngram import NgramProposer, propose_ngram
from jaxserve.sampling.rejection import SpecInputs, emitted_mask, last_emitted

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
# max_num_seqs above the batch: a step has room for proposals (rows + proposals <=
# max_num_seqs logit rows)
SMALL = dict(max_model_len=160, max_num_seqs=64, max_num_batched_tokens=64,
             token_buckets=[16, 64])


# ---------------------------------------------------------------- configuration
def test_config_defaults_and_vllm_lookup_rule():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4,
                                     "prompt_lookup_max": 3})
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (4, 3, 3)
    c = SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 2, '
                                    '"disable_by_batch_size": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.disable_by_batch_size) == (2, 5, 4)


@pytest.mark.parametrize("bad, match", [
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown key"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ("{not json", "not valid JSON"),
    ([1, 2], "mapping"),
])
def test_bad_config_is_a_clear_error(bad, match):
    with pytest.raises(ConfigError, match=match):
        EngineArgs(speculative_config=bad)


def test_cli_flag_and_yaml_mapping(tmp_path):
    p = argparse.ArgumentParser()
    p.add_argument("--config")
    add_cli_args(p)
    ns = p.parse_args(["--speculative-config",
                       '{"method": "ngram", "num_speculative_tokens": 5}'])
    assert engine_args_from_cli(ns).speculative_config["num_speculative_tokens"] == 5
    with pytest.raises(SystemExit):
        p.parse_args(["--speculative-config", "[1]"])
    f = tmp_path / "c.yaml"
    f.write_text("speculative_config:\n  method: ngram\n  num_speculative_tokens: 2\n")
    assert EngineArgs.from_sources(f).speculative_config == {"method": "ngram",
                                                             "num_speculative_tokens": 2}
    f.write_text("speculative_config: 3\n")
    with pytest.raises(ConfigError, match="speculative_config"):
        EngineArgs.from_sources(f)


# ---------------------------------------------------------------- proposals
@pytest.mark.parametrize("tokens, k, lo, hi, want", [
    ([1, 2, 3, 4, 9, 1, 2, 3], 2, 1, 3, [4, 9]),        # trigram 1 2 3 -> 4 9
    ([5, 1, 2, 7, 1, 2, 8, 1, 2], 3, 2, 2, [8, 1, 2]),  # most recent earlier match
    ([1, 2, 3, 4, 9, 7, 3], 3, 2, 3, []),               # no bigram (7 3) before
    ([1, 2, 3, 4, 9, 7, 3], 3, 1, 3, [4, 9, 7]),        # unigram 3 -> 4 9 7
    ([4, 4, 4], 5, 1, 2, [4]),                          # continuation runs to the end
    ([1, 2, 5, 9, 2, 5], 2, 2, 4, [9, 2]),              # longest n first (bigram 2 5)
    ([3], 2, 1, 2, []),
])
def test_propose_ngram(tokens, k, lo, hi, want):
    assert propose_ngram(np.array(tokens, np.int32), k, lo, hi).tolist() == want


def test_proposer_buffer_follows_growing_output():
    pr = NgramProposer(2, 1, 2)
    prompt = [7, 8, 9, 7]
    assert pr.propose("a", prompt, [], 2) == [8, 9]
    assert pr.propose("a", prompt, [8], 2) == [9, 7]
    assert pr.propose("a", prompt, [8, 9, 3], 1) == []
    pr.forget("a")
    assert pr.propose("a", [1, 1], [], 3) == [1]


# ---------------------------------------------------------------- verification mask
def test_emitted_mask_keeps_the_accepted_prefix():
    # rows: A = logit rows 0..3 (3 proposals 5 6 7), B = row 4 (no proposals),
    # C = rows 5..6 (1 proposal 9), row 7 padding
    next_draft = jnp.array([5, 6, 7, -1, -1, 9, -1, -1], jnp.int32)
    row_first = jnp.array([0, 0, 0, 0, 4, 5, 5, 7], jnp.int32)
    spec = SpecInputs(next_draft, row_first)
    valid = jnp.array([1, 1, 1, 1, 1, 1, 1, 0], bool)
    drawn = jnp.array([5, 6, 2, 4, 8, 3, 1, 0], jnp.int32)   # A rejects at 3rd, C at 1st
    em = np.asarray(emitted_mask(drawn, valid, spec))
    assert em.tolist() == [1, 1, 1, 0, 1, 1, 0, 0]
    masked = jnp.where(em, drawn, -1)
    assert np.asarray(last_emitted(masked, spec)).tolist() == [0, 0, 1, 0, 1, 1, 0, 0]
    all_ok = jnp.array([5, 6, 7, 4, 8, 9, 1, 0], jnp.int32)  # every proposal taken + bonus
    assert np.asarray(emitted_mask(all_ok, valid, spec)).tolist() == [1, 1, 1, 1, 1, 1, 1, 0]


# ---------------------------------------------------------------- engine end to end
@pytest.fixture(scope="module")
def model():
    cfg = tiny_config()
    return cfg, tiny_weights(cfg), tiny_tokenizer()


def _make(model, spec=NGRAM, **kw):
    cfg, w, tok = model
    return LLM.from_weights(cfg, w, tok, **{**SMALL, "speculative_config": spec, **kw})


def _run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def prompts():
    """Varied prompts, half copy-heavy (a random span repeated, so the n-gram lookup
    finds the continuation in the prompt)."""
    rnd = random_prompts(8, 128, 3, 40, seed=3)
    spans = random_prompts(8, 128, 4, 12, seed=4)
    copy = [s * 3 + s[:2] for s in spans]
    return [p for pair in zip(rnd, copy) for p in pair]


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(model, prompts):
    return _run(_make(model, spec=None), prompts, GREEDY)


def _cont(reference):
    return [r[0][0] for r in reference]


def _accepts_some(llm):
    st = llm.engine.scheduler.spec_stats
    assert st.num_accepted_tokens > 0, "no proposal was accepted"
    assert st.num_draft_tokens > st.num_accepted_tokens, "no proposal was rejected"


@pytest.mark.slow
def test_greedy_identical_to_plain_decoding_with_ngram(model, prompts, reference):
    llm = _make(model)
    assert _run(llm, prompts, GREEDY) == reference
    _accepts_some(llm)
    kv = llm.engine.kv_manager
    kv.check()
    assert kv.num_free_blocks == kv.num_blocks


def test_greedy_identical_with_mostly_right_proposals(model, prompts, reference):
    llm = _make(model)
    use_oracle(llm, prompts, _cont(reference))
    assert _run(llm, prompts, GREEDY) == reference
    st = llm.engine.scheduler.spec_stats
    _accepts_some(llm)
    assert st.accepted_per_pos[-1] > 0 and st.acceptance_rate > 0.5, st
    kv = llm.engine.kv_manager
    kv.check()
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.slow
def test_chunked_prefill_and_preemption_forced(model, prompts, reference):
    llm = _make(model, max_num_batched_tokens=24, token_buckets=[8, 24], num_kv_blocks=14)
    use_oracle(llm, prompts, _cont(reference))
    chunked = spy_chunked_prefills(llm)
    assert _run(llm, prompts, GREEDY) == reference
    assert chunked, "no prompt was chunked"
    assert llm.engine.scheduler.num_preemptions > 0, "no request was preempted"
    _accepts_some(llm)


@pytest.mark.parametrize("pipeline", [True, False])
@pytest.mark.slow
def test_stops_lengths_n_and_logprobs_match(model, prompts, reference, pipeline):
    # EOS not ignored, stop tokens (a token the greedy output reaches), stop strings,
    # max_tokens of every size, n = 2 and logprobs: all as without speculation (lengths
    # never overshoot max_tokens).
    tok_ids = [p[0] for p in prompts[1::2]]
    params = [SamplingParams(max_tokens=mt, temperature=0.0, n=2, logprobs=2,
                             stop_token_ids=[reference[i][0][0][3 + i % 9]] if i % 2 else [],
                             stop=[f"w{tok_ids[(i + 3) % len(tok_ids)]}"] if i % 3 == 0 else [])
              for i, mt in enumerate([1, 2, 3, 5, 8, 13, 21, 30] * 2)]
    ref = _make(model, spec=None, pipeline_steps=pipeline)
    llm = _make(model, pipeline_steps=pipeline)
    use_oracle(llm, prompts, _cont(reference))

    def run(m):
        outs = m.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return ([[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs]
                 for o in outs],
                [[[sorted((t, lp.logprob) for t, lp in e.items()) for e in c.logprobs]
                  for c in o.outputs] for o in outs])
    (got, got_lp), (want, want_lp) = run(llm), run(ref)
    assert got == want
    assert {c[1] for o in got for c in o} == {"stop", "length"}
    for o, p in zip(got, params):
        assert all(len(c[0]) <= p.max_tokens for c in o)
    for a, b in zip(got_lp, want_lp):       # the target's logprobs, entry for entry
        for ca, cb in zip(a, b):
            assert len(ca) == len(cb)
            for ea, eb in zip(ca, cb):
                assert [t for t, _ in ea] == [t for t, _ in eb]
                np.testing.assert_allclose([v for _, v in ea], [v for _, v in eb], atol=1e-4)
    _accepts_some(llm)


def test_prefix_cache_hits_stay_exact(model, prompts, reference):
    llm = _make(model)
    use_oracle(llm, prompts, _cont(reference))
    assert _run(llm, prompts, GREEDY) == reference
    q0 = llm.engine.kv_manager.stats.hits
    assert _run(llm, prompts, GREEDY) == reference       # now from the prefix cache
    assert llm.engine.kv_manager.stats.hits > q0


@pytest.mark.slow
def test_disable_by_batch_size_and_per_request_off(model, prompts, reference):
    llm = _make(model, spec={**NGRAM, "disable_by_batch_size": 4})
    use_oracle(llm, prompts, _cont(reference))
    sizes = []
    orig = llm.engine.scheduler.schedule

    def spy(speculate=False):
        so = orig(speculate=speculate)
        if so.scheduled_spec_decode_tokens:
            sizes.append(len(so.num_scheduled_tokens))
        return so
    llm.engine.scheduler.schedule = spy
    # lengths 6..21: requests finish one by one, so the batch shrinks below the limit
    lengths = [6 + i for i in range(len(prompts))]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lengths]
    assert _run(llm, prompts, params) == [[(r[0][0][:m], "length")]
                                          for r, m in zip(reference, lengths)]
    assert sizes and max(sizes) <= 4, sizes
    off = _make(model)
    use_oracle(off, prompts, _cont(reference))
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, speculative=False)
    assert _run(off, prompts, plain) == reference
    assert off.engine.scheduler.spec_stats.num_drafts == 0


@pytest.mark.warmup
def test_no_recompiles_after_warmup(model, prompts):
    llm = _make(model)
    warm = llm.num_compiles
    _run(llm, prompts, GREEDY)
    _run(llm, prompts[:3], SamplingParams(max_tokens=9, temperature=0.8, top_k=5,
                                          presence_penalty=0.5, seed=1, ignore_eos=True))
    _run(llm, random_prompts(3, 128, 50, 110, seed=9), SamplingParams(max_tokens=5))
    assert llm.engine.scheduler.spec_stats.num_drafts > 0
    assert llm.num_compiles == warm


def test_metrics_snapshot_and_prometheus(model, prompts, reference):
    from jaxserve.server.metrics import ServerMetrics
    llm = _make(model)
    use_oracle(llm, prompts, _cont(reference))
    _run(llm, prompts, GREEDY)
    snap = llm.engine.snapshot()
    st = llm.engine.scheduler.spec_stats
    assert snap.spec_draft_tokens == st.num_draft_tokens > 0
    assert sum(snap.spec_accepted_per_pos) == snap.spec_accepted_tokens
    assert snap.spec_accepted_per_pos[0] >= snap.spec_accepted_per_pos[-1]
    d = dict(snap.as_dict(), errored=False)
    text = ServerMetrics("m", lambda: d).render().decode()
    assert f'jaxserve:spec_decode_num_draft_tokens_total{{model_name="m"}} ' \
           f'{float(snap.spec_draft_tokens)}' in text
    assert 'spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"}' in text
    rate = snap.spec_accepted_tokens / snap.spec_draft_tokens
    assert f"jaxserve:spec_decode_acceptance_rate{{model_name=\"m\"}} {rate}" in text
