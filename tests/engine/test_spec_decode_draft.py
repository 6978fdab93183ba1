"""Device drafters (speculative decoding with `self` and `draft_model`): configuration,
compatibility checks, and the engine end to end. The truth: the same engine without
speculation (greedy and seeded outputs must be token-identical), hand-written
expectations for the checks, and the compile counter."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine_pool import release
from engine_utils import random_prompts, tiny_config, tiny_tokenizer, tiny_weights
from spec_utils import drafting_target, save_checkpoint, spy_chunked_prefills
from jaxserve import SamplingParams
from jaxserve.config import ConfigError, EngineArgs
from jaxserve.frontend.llm import LLM
from jaxserve.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from jaxserve.worker.drafter.draft import check_compatible

K = 3
SELF = {"method": "self", "draft_num_layers": 2, "num_speculative_tokens": K}
# num_kv_blocks: room for every request of a test at once (not a pool sized by bytes,
# thousands of blocks): the module keeps several engines alive at a time
SMALL = dict(max_model_len=160, max_num_seqs=64, max_num_batched_tokens=64,
             token_buckets=[16, 64], num_kv_blocks=256)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


# ---------------------------------------------------------------- configuration
def test_config_self_and_draft_model():
    c = SpeculativeConfig.from_dict(SELF)
    assert (c.method, c.draft_num_layers, c.num_speculative_tokens) == ("self", 2, K)
    assert c.prompt_lookup_max is None and c.model is None
    c = SpeculativeConfig.from_dict('{"method": "draft_model", "model": "/m", '
                                    '"num_speculative_tokens": 2, "disable_by_batch_size": 4}')
    assert (c.model, c.disable_by_batch_size, c.draft_num_layers) == ("/m", 4, None)


@pytest.mark.parametrize("bad, match", [
    ({"method": "self", "num_speculative_tokens": 2}, "draft_num_layers is required"),
    ({"method": "self", "num_speculative_tokens": 2, "draft_num_layers": 0},
     "draft_num_layers"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model is required"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/m",
      "draft_num_layers": 2}, "do not apply"),
    ({"method": "self", "num_speculative_tokens": 2, "draft_num_layers": 1,
      "prompt_lookup_max": 3}, "do not apply"),
])
def test_bad_draft_config_is_a_clear_error(bad, match):
    with pytest.raises(ConfigError, match=match):
        EngineArgs(speculative_config=bad)


class _Tok:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def test_check_compatible():
    cfg = tiny_config()
    tok = _Tok({"a": 0, "b": 1})
    check_compatible(cfg, tok, cfg, _Tok({"b": 1, "a": 0}), 512)       # same: no error
    check_compatible(cfg, None, cfg, tok, 512)                         # nothing to compare
    with pytest.raises(SpeculativeConfigError, match="vocabulary has 64 tokens"):
        check_compatible(tiny_config(vocab_size=64), tok, cfg, tok, 512)
    with pytest.raises(SpeculativeConfigError, match="tokenizer differs"):
        check_compatible(cfg, _Tok({"a": 1, "b": 0}), cfg, tok, 512)
    with pytest.raises(SpeculativeConfigError, match="max_model_len 1024"):
        check_compatible(cfg, tok, cfg, tok, 1024)


# ---------------------------------------------------------------- models
@pytest.fixture(scope="module")
def model():
    return drafting_target()


@pytest.fixture(scope="module")
def draft_path(model, tmp_path_factory):
    """A draft checkpoint: the target's first two layers, norm and head."""
    cfg, w, tok = model
    return save_checkpoint(dataclasses.replace(cfg, num_layers=2),
                           {**w, "layers": w["layers"][:2]}, tok,
                           tmp_path_factory.mktemp("draft"))


def _spec(method, draft_path):
    if method == "self":
        return SELF
    return {"method": "draft_model", "model": draft_path, "num_speculative_tokens": K}


def _make(model, spec, **kw):
    cfg, w, tok = model
    return LLM.from_weights(cfg, w, tok, **{**SMALL, "speculative_config": spec, **kw})


def _run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def built():
    """Engines of this module's most used settings, built once and shared by its tests
    (each test gets them clean: `engines`): the plain engine (the truth), the `self` and
    `draft_model` engines (warmed up at start: the first test counts compiles after
    warm-up) and the draft alone."""
    return {}


def _shared(built, model, draft_path, key):
    if key not in built:
        if key == "plain":
            built[key] = _make(model, None, warmup=False)
        elif key == "alone":
            cfg, w, tok = model
            built[key] = LLM.from_weights(dataclasses.replace(cfg, num_layers=2),
                                          {**w, "layers": w["layers"][:2]}, tok, **SMALL,
                                          warmup=False)
        else:
            built[key] = _make(model, _spec(key, draft_path), warmup=True)
    return built[key]


@pytest.fixture
def engines(built, model, draft_path):
    """engines(key) -> the module's shared engine; each one used is returned to a clean
    state (requests drained, prefix cache reset, every block checked free) after the test."""
    used = []

    def get(key):
        used.append(_shared(built, model, draft_path, key))
        return used[-1]
    yield get
    for llm in used:
        release(llm)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(12, 128, 3, 40, seed=3)


@pytest.fixture(scope="module")
def reference(built, model, draft_path, prompts):
    plain = _shared(built, model, draft_path, "plain")
    ref = _run(plain, prompts, GREEDY)
    release(plain)
    return ref


class _Counts:
    """The engine's speculation counters from now on (shared engines count on)."""

    def __init__(self, llm) -> None:
        self.st = llm.engine.scheduler.spec_stats
        self.accepted0, self.drafted0 = self.st.num_accepted_tokens, self.st.num_draft_tokens
        self.all_k0 = self.st.accepted_per_pos[-1]

    @property
    def accepted(self) -> int:
        return self.st.num_accepted_tokens - self.accepted0

    @property
    def drafted(self) -> int:
        return self.st.num_draft_tokens - self.drafted0

    @property
    def accepted_all_k(self) -> int:
        return self.st.accepted_per_pos[-1] - self.all_k0


def _accepts_some(counts: _Counts) -> None:
    assert counts.accepted > 0, "no proposal was accepted"
    assert counts.drafted > counts.accepted, "no proposal was rejected"


# ---------------------------------------------------------------- end to end
@pytest.mark.warmup
@pytest.mark.parametrize("method", ["self", "draft_model"])
@pytest.mark.slow
def test_greedy_identical_and_no_recompiles(engines, prompts, reference, method):
    llm = engines(method)
    warm = llm.num_compiles
    counts = _Counts(llm)
    assert _run(llm, prompts, GREEDY) == reference
    _accepts_some(counts)
    assert counts.accepted_all_k > 0, counts.st          # some steps accept all k
    # sampled rows, other lengths and a second wave: still no compile after warm-up
    _run(llm, prompts[:4], SamplingParams(max_tokens=9, temperature=0.8, top_k=5,
                                          presence_penalty=0.5, seed=1, ignore_eos=True))
    _run(llm, random_prompts(3, 128, 50, 110, seed=9), SamplingParams(max_tokens=5))
    assert llm.num_compiles == warm
    kv = llm.engine.kv_manager
    kv.check()
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("method", ["self", "draft_model"])
@pytest.mark.slow
def test_proposals_are_the_drafts_own_greedy_continuation(engines, prompts, method,
                                                          monkeypatch):
    """Each step's proposals equal what a plain engine running the 2-layer draft alone
    decodes greedily from the same tokens: for `self` this checks that reading the
    target's cache for layers < L is the draft's own KV (same weights, same inputs);
    for `draft_model` that its mirrored pool is caught up on prompt and accepted tokens."""
    llm = engines(method)
    drafter, states = llm.engine.runner.drafter, llm.engine.runner.states
    seen: list[tuple[list[int], list[int]]] = []
    orig = drafter.propose

    def spy(so):
        before = {rid: list(states[rid].token_ids) for rid in so.scheduled_spec_decode_tokens}
        got = orig(so)
        seen.extend((before[rid], d) for rid, d in got.tokens.items())
        return got
    monkeypatch.setattr(drafter, "propose", spy)
    _run(llm, prompts[:6], GREEDY)
    assert len(seen) > 12
    sample = seen[::len(seen) // 12][:12]
    alone = engines("alone")
    outs = alone.generate([{"prompt_token_ids": p} for p, _ in sample],
                          [SamplingParams(max_tokens=len(d), temperature=0.0, ignore_eos=True)
                           for _, d in sample], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [d for _, d in sample]


@pytest.mark.parametrize("method", ["self", "draft_model"])
@pytest.mark.slow
def test_chunked_prefill_and_preemption_forced(model, prompts, reference, draft_path, method):
    llm = _make(model, _spec(method, draft_path), max_num_batched_tokens=24,
                token_buckets=[8, 24], num_kv_blocks=14)
    chunked = spy_chunked_prefills(llm)
    counts = _Counts(llm)
    assert _run(llm, prompts, GREEDY) == reference
    assert chunked, "no prompt was chunked"
    assert llm.engine.scheduler.num_preemptions > 0, "no request was preempted"
    _accepts_some(counts)


@pytest.mark.parametrize("method", ["self", "draft_model"])
@pytest.mark.slow
def test_seeded_sampling_identical_to_plain_and_reproducible(engines, prompts, method):
    # seeded rows keep argmax drafting and matching: each emitted token is the target's
    # own draw with that position's seeded uniform, as without speculation — also on the
    # second run, whose prompts hit the prefix cache (other chunk ends, other steps)
    params = [SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=100 + i,
                             frequency_penalty=0.3, ignore_eos=True)
              for i in range(len(prompts))]
    plain = _run(engines("plain"), prompts, params)
    llm = engines(method)
    counts = _Counts(llm)
    assert _run(llm, prompts, params) == plain
    assert _run(llm, prompts, params) == plain
    assert counts.accepted > 0


@pytest.mark.slow
def test_draft_model_with_its_own_geometry(model, prompts, reference, tmp_path):
    """Any checkpoint with the target's vocabulary: a random draft of another shape
    (one layer, hidden 32, one KV head of 8) keeps outputs exact; its pool has the
    draft's geometry on the target's block ids."""
    cfg, _, tok = model
    dcfg = tiny_config(num_layers=1, hidden_size=32, intermediate_size=64, num_heads=4,
                       num_kv_heads=1, head_dim=8)
    path = save_checkpoint(dcfg, tiny_weights(dcfg, seed=7), tok, tmp_path / "other")
    llm = _make(model, {"method": "draft_model", "model": path, "num_speculative_tokens": 2})
    assert _run(llm, prompts, GREEDY) == reference
    assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0
    drafter = llm.engine.runner.drafter
    k_pool = drafter.model.kv[0][0]
    assert len(drafter.model.kv) == 1
    assert k_pool.shape == (1, llm.engine.kv_manager.num_blocks, llm.args.block_size, 8)


@pytest.mark.slow
def test_draft_errors_at_engine_build(model, tmp_path):
    with pytest.raises(SpeculativeConfigError, match=r"draft_num_layers: 3 must be in \[1, 2\]"):
        _make(model, {**SELF, "draft_num_layers": 3})
    small = tiny_config(vocab_size=64)
    path = save_checkpoint(small, tiny_weights(small), tiny_tokenizer(64), tmp_path / "v64")
    with pytest.raises(SpeculativeConfigError, match="vocabulary has 64 tokens"):
        _make(model, {"method": "draft_model", "model": path, "num_speculative_tokens": 2})
    with pytest.raises(SpeculativeConfigError, match="cannot load"):
        _make(model, {"method": "draft_model", "model": str(tmp_path / "missing"),
                      "num_speculative_tokens": 2})


def test_draft_steps_inputs():
    """The k steps' metadata against a hand-worked row: p = 5, k_r = 2 of k = 3,
    block size 4, blocks [7, 9]; the third step repeats the second without writing."""
    from jaxserve.worker.drafter.draft_inputs import DraftRow, DraftShapes, build_draft_steps
    table = np.zeros((3, 4), np.int32)
    table[1, :2] = [7, 9]
    shapes = DraftShapes(rows=(2, 4), widths=(2, 4))
    packed = build_draft_steps([DraftRow(1, 5, 42, 2)], 3, table, shapes, block_size=4,
                               num_blocks=10, full_tables=False)
    tokens, m = packed.unpack("draft")          # (numpy words unpack on the host)
    assert np.asarray(tokens).tolist() == [42, 0]
    assert np.asarray(m.positions)[:, 0].tolist() == [5, 6, 6]
    assert np.asarray(m.slot_mapping)[:, 0].tolist() == [9 * 4 + 1, 9 * 4 + 2, 40]
    assert np.asarray(m.slot_mapping)[:, 1].tolist() == [40, 40, 40]       # padding row
    assert np.asarray(m.context_lens)[:, 0].tolist() == [5, 6, 6]
    assert np.asarray(m.seq_lens)[:, 0].tolist() == [6, 7, 7]
    assert np.asarray(m.seq_lens)[:, 1].tolist() == [0, 0, 0]
    assert np.asarray(m.block_tables).shape == (3, 2, 2)              # R = 2, P = 2
    assert np.asarray(m.block_tables)[0, 0].tolist() == [7, 9]
    assert np.asarray(m.query_start_loc)[0].tolist() == [0, 1, 1]
