"""Structured outputs (a JSON schema) with a LoRA adapter on SmolLM2-135M-Instruct: the
adapter's greedy output parses and follows the schema, and differs from the base
model's under the same schema (the adapter is applied while the grammar constrains)."""
from __future__ import annotations

import json

import jsonschema
import pytest

from lora_utils import save_adapter
from jaxserve.lora import LoRARequest
from jaxserve.sampling.params import SamplingParams

SCHEMA = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]},
    "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["color", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def setup(default_model, tmp_path_factory):
    from jaxserve.frontend.llm import LLM
    m = default_model
    path = save_adapter(tmp_path_factory.mktemp("adapter") / "a", m.config, rank=4, seed=7,
                        targets=("q_proj", "v_proj", "down_proj"), std=0.05)
    llm = LLM.from_weights(m.config, m.weights, m.tokenizer, enable_lora=True, max_loras=1,
                           max_lora_rank=4, max_model_len=128, max_num_seqs=2,
                           max_num_batched_tokens=32, token_buckets=[32])
    return llm, LoRARequest("a", 1, str(path))


def test_json_schema_with_adapter(setup):
    llm, req = setup
    prompt = llm.apply_chat_template([{"role": "user", "content": "Pick a color and a "
                                       "digit, as JSON."}])
    params = SamplingParams(temperature=0.0, max_tokens=24,
                            structured_outputs={"json": SCHEMA})
    # one batch, a base row beside an adapter row (the engine holds two sequences): the
    # adapter must reach its own row only, under the same constraint
    base, adapted = (o.outputs[0] for o in llm.generate(
        [{"prompt_token_ids": prompt}] * 2, params, use_tqdm=False, lora_request=[None, req]))
    for c in (base, adapted):
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert adapted.token_ids != base.token_ids, (base.text, adapted.text)
