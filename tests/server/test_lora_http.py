"""LoRA adapters over HTTP with the official openai client: `model: <adapter>` selects
one (its output equals transformers with the adapter merged), /v1/models lists adapters
with their parent, the runtime load / unload routes (behind the API key) and their
errors, and vLLM's lora_requests_info metric."""
from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_utils import hf_greedy, hf_model_from_weights
from lora_utils import merge_into, save_adapter
from server_harness import MODEL_NAME, ServerThread, tiny_args, tiny_parts

KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [5, 17, 33, 9, 60, 71, 12]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from jaxserve.server.launch import build_engine
    cfg, weights, tok = tiny_parts()
    root = tmp_path_factory.mktemp("adapters")
    paths = {name: save_adapter(root / name, cfg, rank=r, seed=s, targets=t)
             for name, r, s, t in [("a0", 4, 1, ("q_proj", "v_proj", "down_proj")),
                                   ("a1", 8, 2, ("o_proj", "up_proj"))]}
    args = tiny_args(enable_lora=True, max_loras=2, max_lora_rank=8,
                     lora_modules=[f"a0={paths['a0']}"], allow_runtime_lora_updating=True,
                     api_key=KEY, metrics_compat="vllm")
    srv = ServerThread(build_engine(args, cfg, weights, tok, warmup=True), tok, args)
    srv.paths, srv.cfg, srv.weights, srv.tok = paths, cfg, weights, tok
    yield srv
    srv.stop()


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)


def _reference_text(srv, name: str | None, n: int) -> str:
    hf = hf_model_from_weights(srv.cfg, srv.weights)
    if name is not None:
        merge_into(hf, srv.paths[name])
    return srv.tok.decode(hf_greedy(hf, PROMPT, n))


def _complete(srv, model: str, n: int = 6) -> str:
    out = _client(srv).completions.create(model=model, prompt=PROMPT, max_tokens=n,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert out.model == model
    return out.choices[0].text.strip()   # the word tokenizer joins with spaces


def test_models_and_generation(server):
    cards = {m.id: m for m in _client(server).models.list().data}
    assert set(cards) == {MODEL_NAME, "a0"}
    assert cards["a0"].parent == MODEL_NAME and cards["a0"].root == "a0"
    assert _client(server).models.retrieve("a0").parent == MODEL_NAME
    adapted, base = _complete(server, "a0"), _complete(server, MODEL_NAME)
    assert adapted == _reference_text(server, "a0", 6)
    assert base == _reference_text(server, None, 6) and adapted != base
    chat = _client(server).chat.completions.create(
        model="a0", messages=[{"role": "user", "content": "w5 w6"}], max_tokens=3,
        temperature=0)
    assert chat.model == "a0" and chat.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError) as e:
        _complete(server, "nope")
    assert e.value.body["code"] == "model_not_found"


def test_load_and_unload_at_run_time(server):
    url = server.url
    body = {"lora_name": "a1", "lora_path": str(server.paths["a1"])}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=body).status_code == 401
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    assert "a1" in {m.id for m in _client(server).models.list().data}
    assert _complete(server, "a1") == _reference_text(server, "a1", 6)
    for bad, needle in [(body, "taken"),
                        ({"lora_name": "x", "lora_path": "/nonexistent"}, "no such adapter"),
                        ({"lora_name": "y", "lora_path": str(server.paths["a1"].parent)},
                         "not a PEFT adapter directory")]:
        r = httpx.post(f"{url}/v1/load_lora_adapter", json=bad, headers=AUTH)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a1"}, headers=AUTH)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        _complete(server, "a1")
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a1"}, headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
    assert _complete(server, "a0") == _reference_text(server, "a0", 6)   # unaffected


def test_lora_requests_info_metric(server):
    text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    (sample,) = fams["vllm:lora_requests_info"].samples
    assert sample.labels["max_lora"] == "2"
    assert {"running_lora_adapters", "waiting_lora_adapters"} <= set(sample.labels)
    assert sample.value > 1e9          # vLLM's: the time of the reading
