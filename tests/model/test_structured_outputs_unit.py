"""Structured outputs, host path, without a model: the token bitmask against a numpy
reference, the sampler honouring it, intake validation (400 messages), the HTTP field
mapping, and the grammar backend / matcher on the default model's real tokenizer."""
from __future__ import annotations

import re
import time
from concurrent.futures import Future

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.sampling.bitmask import apply_token_bitmask, mask_logits
from jaxserve.sampling.params import SamplingParams, SamplingParamsError, \
    StructuredOutputsParams as SOP


def np_apply(logits: np.ndarray, words: np.ndarray) -> np.ndarray:
    """Reference: token t of row r is allowed iff bit t % 32 of word t // 32 is set."""
    out = logits.copy()
    u = words.view(np.uint32)
    for r in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            w = t // 32
            if w >= u.shape[1] or not (int(u[r, w]) >> (t % 32)) & 1:
                out[r, t] = -np.inf
    return out


@pytest.mark.parametrize("V,W", [(100, 4), (96, 3), (70, 2)])   # wider, exact, narrower
def test_apply_token_bitmask_matches_numpy(V, W):
    rng = np.random.default_rng(V)
    logits = rng.standard_normal((6, V)).astype(np.float32)
    words = rng.integers(-2**31, 2**31, (6, W), dtype=np.int64).astype(np.int32)
    words[0] = -1                                  # unconstrained row
    words[1] = 0
    words[1, 0] = np.int32(-2**31)                 # only token 31 (the sign bit)
    want = np_apply(logits, words)
    got = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(words)))
    np.testing.assert_array_equal(got, want)
    for branch in (True, False):
        got = np.asarray(mask_logits(jnp.asarray(logits), jnp.asarray(words), branch=branch))
        np.testing.assert_array_equal(got, want)
    if W * 32 >= V:
        np.testing.assert_array_equal(got[0], logits[0])
    assert np.isfinite(got[1]).sum() == 1 and np.isfinite(got[1, 31])


def test_mask_logits_all_ones_is_identity():
    logits = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    ones = jnp.full((4, 2), -1, jnp.int32)
    for branch in (True, False):
        np.testing.assert_array_equal(
            np.asarray(mask_logits(jnp.asarray(logits), ones, branch=branch)), logits)


def test_sampler_draws_only_allowed_tokens():
    """Through the runner's sampling glue: each row allows one token (greedy rows and
    temperature-1 rows alike, with bias pushing elsewhere) and must draw it."""
    from jaxserve.sampling import in_step as sg
    from jaxserve.sampling.metadata import build_sampling_metadata
    import jax
    R, V = 4, 256
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=1.0, top_k=5, logit_bias={7: 50.0}),
              SamplingParams(temperature=0.7)]
    md = build_sampling_metadata(params, [0] * R, [()] * R, R, V)
    allowed = [200, 3, 255, 64]
    words = np.zeros((R, V // 32), np.int32)
    for r, t in enumerate(allowed):
        words[r, t // 32] = np.array([1 << (t % 32)], np.uint32).view(np.int32)[0]
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((R, V)).astype(np.float32))
    for plan in sg.all_plans(True) + sg.all_plans(False):
        inputs = sg.SamplingInputs(md, np.arange(R, dtype=np.int32), np.ones(R, bool),
                                   np.bool_(False), np.int32(5), token_mask=words)
        if not plan.sampler.branch:
            plan = sg.plan_for(inputs)
        out, _ = sg.sample(logits, jax.tree_util.tree_map(jnp.asarray, inputs),
                           sg.init_state(R, V), jax.random.PRNGKey(0), num_logprobs=0,
                           plan=plan)
        assert np.asarray(out.token_ids).tolist() == allowed, plan


# ---- intake validation (the 400s) --------------------------------------------------------
@pytest.mark.parametrize("so,needle", [
    (SOP(json="{not json"), "invalid JSON schema: not valid JSON"),
    (SOP(json={"type": "objectx"}), "invalid JSON schema"),
    (SOP(json=[1, 2]), "invalid JSON schema: must be a JSON object"),
    (SOP(regex="[0-9"), "invalid regex"),
    (SOP(grammar="root ::= (\"a\""), "invalid grammar"),
    (SOP(grammar="x" * 70_000), "grammar too large: 70000 characters"),
    (SOP(json={"enum": ["a" * 70_000]}), "JSON schema too large"),
])
def test_validate_names_the_problem(so, needle):
    from jaxserve.structured.grammar import validate
    with pytest.raises(SamplingParamsError) as e:
        validate(so)
    assert e.value.param == "structured_outputs"
    assert needle in str(e.value), str(e.value)


@pytest.mark.parametrize("so", [SOP(json={"type": "object"}), SOP(json_object=True),
                                SOP(regex=r"\d{3}"), SOP(choice=["a", "b c"]),
                                SOP(grammar='root ::= "a" | "b"'),
                                SOP(grammar='start: "x" NUM\nNUM: /[0-9]+/')])
def test_validate_accepts_good_constraints(so):
    from jaxserve.structured.grammar import validate
    validate(so)


def test_input_processor_refuses_bad_regex():
    from jaxserve.frontend.input_processor import InputLimits, InputProcessor
    ip = InputProcessor(InputLimits(), vocab_size=100, max_model_len=64)
    with pytest.raises(SamplingParamsError, match="invalid regex"):
        ip.check_structured(SamplingParams(structured_outputs={"regex": "(a"}))


# ---- HTTP fields -> StructuredOutputsParams -----------------------------------------------
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("body,want", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, SOP(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": True}}}, SOP(json=SCHEMA)),
    ({"structured_outputs": {"regex": "a+"}}, SOP(regex="a+")),
    ({"structured_outputs": {"json": SCHEMA}}, SOP(json=SCHEMA)),
    ({"guided_choice": ["x", "y"]}, SOP(choice=["x", "y"])),
    ({"guided_grammar": "root ::= \"a\""}, SOP(grammar="root ::= \"a\"")),
    ({"guided_json": SCHEMA}, SOP(json=SCHEMA)),
])
def test_request_fields_map(body, want):
    from jaxserve.server.protocol import ChatCompletionRequest, CompletionRequest
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body)
    comp = CompletionRequest(prompt="hi", **body)
    assert chat.sampling_params().structured_outputs == want
    assert comp.sampling_params().structured_outputs == want


@pytest.mark.parametrize("body,param", [
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
])
def test_request_fields_refused(body, param):
    from jaxserve.server.protocol import CompletionRequest
    with pytest.raises(SamplingParamsError) as e:
        CompletionRequest(prompt="hi", **body).sampling_params()
    assert e.value.param == param


# ---- backend + matcher on the real tokenizer ----------------------------------------------
@pytest.fixture(scope="module")
def backend():
    from jaxserve.model.tokenizer.gguf import load_gguf_tokenizer
    from jaxserve.model.loader.default_model import default_gguf_path
    from jaxserve.structured.backend import GrammarBackend
    tok = load_gguf_tokenizer(default_gguf_path())
    b = GrammarBackend(tok, vocab_size=len(tok), eos_token_ids=(tok.eos_token_id,))
    b.hf = tok
    yield b
    b.shutdown()


def _ready(backend, so):
    from jaxserve.structured.matcher import RequestGrammar
    g = RequestGrammar(backend.submit(so))
    deadline = time.monotonic() + 60
    while not g.ready(backend):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert g.error is None, g.error
    return g


def _allowed(words: np.ndarray) -> set[int]:
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    return set(np.nonzero(bits)[0].tolist())


def test_matcher_regex_walk_rollback_and_termination(backend):
    from jaxserve.structured.matcher import fill_bitmasks
    tok, eos = backend.hf, backend.hf.eos_token_id
    g = _ready(backend, SOP(regex=r"[0-9]{3}-ok"))
    first = _allowed(fill_bitmasks(backend, [g])[0])
    assert first and all(re.fullmatch(r"[0-9]{1,3}(-(o(k)?)?)?", tok.decode([t]))
                         for t in first), sorted(first)[:20]
    assert eos not in first                         # EOS only when the grammar is done
    ids = tok.encode("123-ok", add_special_tokens=False)
    for t in ids[:-1]:
        assert g.accept(t) and not g.terminated()
    mid = fill_bitmasks(backend, [g])[0].copy()
    assert g.accept(ids[-1]) and g.terminated()
    assert _allowed(fill_bitmasks(backend, [g])[0]) == {eos}
    g.rollback_to(len(ids) - 1)                     # preemption keeps one token fewer
    assert not g.terminated()
    np.testing.assert_array_equal(fill_bitmasks(backend, [g])[0], mid)
    assert not g.accept(tok.encode("x", add_special_tokens=False)[0])   # rejected


def test_backend_caches_compiles_and_batches_masks(backend):
    from jaxserve.structured.matcher import fill_bitmasks
    so = SOP(choice=["alpha", "beta"])
    assert backend.submit(so) is backend.submit(SOP(choice=["alpha", "beta"]))
    gs = [_ready(backend, so), _ready(backend, SOP(json={"type": "integer"}))]
    words = fill_bitmasks(backend, gs)
    assert words.shape == (2, (backend.vocab_size + 31) // 32)
    a, b = _allowed(words[0]), _allowed(words[1])
    assert all("alpha".startswith(backend.hf.decode([t])) or
               "beta".startswith(backend.hf.decode([t])) for t in a)
    assert all(re.fullmatch(r"-?[0-9]*", backend.hf.decode([t])) for t in b)


def test_gate_fails_a_slow_compile_alone(backend):
    """A compile past the timeout fails its request with the reason; the key is then
    remembered as failed (a resend fails at once)."""
    from jaxserve.request import Request, RequestStatus
    from jaxserve.structured.backend import CompileJob
    from jaxserve.structured.matcher import RequestGrammar
    from jaxserve.structured.scheduling import GrammarGate
    gate = GrammarGate(backend)
    slow = Request("slow", [1, 2], SamplingParams(structured_outputs={"regex": "s+"}))
    fast = Request("fast", [1, 2], SamplingParams(structured_outputs={"regex": "f+"}))
    assert gate.hold(slow) and gate.hold(fast)
    assert slow.status is RequestStatus.WAITING_FOR_FSM
    stuck = CompileJob("regex:s+", Future(), started=time.monotonic() - 1e3)
    gate.grammars["slow"] = RequestGrammar(stuck)
    deadline = time.monotonic() + 60
    ready, failed = [], []
    while len(ready) + len(failed) < 2:
        assert time.monotonic() < deadline
        r, f = gate.release(time.monotonic())
        ready, failed = ready + r, failed + f
    assert [r.request_id for r in ready] == ["fast"] and ready[0].status is RequestStatus.WAITING
    assert [r.request_id for r in failed] == ["slow"]
    assert "took longer than" in failed[0].error
    assert backend.submit(SOP(regex="s+")).future.exception() is not None
