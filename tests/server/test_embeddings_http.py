"""/v1/embeddings over HTTP: an in-process server on a tiny random Qwen3
sentence-transformers checkpoint (last-token pooling, normalised), started with
`task="embed"`, with the official `openai` client, against transformers' AutoModel.

Also: float and base64 encodings agree, token-id inputs equal their text, `dimensions`
cuts and re-normalises, usage counts the input tokens, every KV block is free after,
and the 400s (context length, too many inputs, dimensions, the completion routes on an
embedding server, /v1/embeddings on a generation server); /v1/models still lists the
model. The CLI flags `--task` and `--pooler-config` reach EngineArgs.
"""
from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from embed_utils import cosine, reference_embeddings, save_embedding_checkpoint
from scripted_engine import ScriptedEngine, app_client
from server_harness import MODEL_NAME, ServerThread, tiny_args, wait_kv_free

MAX_INPUTS = 8
TEXTS = ["w5", "w7 w9 w11 w13", " ".join(f"w{3 + i % 120}" for i in range(100))]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from jaxserve.model.loader.load import load_model
    from jaxserve.server.launch import build_engine
    ckpt = save_embedding_checkpoint(tmp_path_factory.mktemp("st_last"), pooling="lasttoken")
    # the 100-token input is two chunks of a 64-token step
    args = tiny_args(model=str(ckpt), task="embed", max_sequences_per_request=MAX_INPUTS,
                     token_buckets=[16, 64], num_kv_blocks=32, dtype="float32")
    loaded = load_model(str(ckpt), dtype="float32")
    engine = build_engine(args, loaded.config, loaded.weights, loaded.tokenizer)
    srv = ServerThread(engine, loaded.tokenizer, args)
    ids = [loaded.tokenizer.encode(t) for t in TEXTS]
    yield srv, ids, reference_embeddings(ckpt, ids, "last", normalize=False)
    srv.stop()


def _post(srv, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/embeddings", json={"model": MODEL_NAME, **body},
                      timeout=60)


def test_openai_client_matches_transformers(server):
    srv, ids, raw = server
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
    res = client.embeddings.create(model=MODEL_NAME, input=TEXTS)     # base64 on the wire
    assert [d.index for d in res.data] == [0, 1, 2]
    for d, r in zip(res.data, raw):
        assert cosine(np.array(d.embedding), r) >= 0.9999
        assert abs(np.linalg.norm(d.embedding) - 1) < 1e-5
    n = sum(map(len, ids))
    assert res.usage.prompt_tokens == res.usage.total_tokens == n
    assert wait_kv_free(srv.url)["num_free_blocks"] == 32


def test_float_base64_token_ids_and_dimensions(server):
    srv, ids, raw = server
    floats = _post(srv, {"input": TEXTS, "encoding_format": "float"}).json()["data"]
    b64 = _post(srv, {"input": ids, "encoding_format": "base64"}).json()["data"]
    for f, b in zip(floats, b64):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), "<f4")
        assert np.array_equal(decoded, np.array(f["embedding"], np.float32))
    one = _post(srv, {"input": ids[1]}).json()["data"]      # one token-id list
    assert len(one) == 1 and np.allclose(one[0]["embedding"], floats[1]["embedding"],
                                         atol=1e-6)
    cut = _post(srv, {"input": TEXTS[1], "dimensions": 16}).json()["data"][0]["embedding"]
    assert len(cut) == 16 and abs(np.linalg.norm(cut) - 1) < 1e-5
    assert cosine(np.array(cut), raw[1][:16]) >= 0.9999


def test_400s(server):
    srv, ids, _ = server
    r = _post(srv, {"input": ["w5"] * (MAX_INPUTS + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    r = _post(srv, {"input": [5] * 129})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert err["message"].startswith("This model's maximum context length is 128 tokens.")
    assert _post(srv, {"input": [5] * 128}).status_code == 200       # a full context fits
    for dims in (0, 65):
        r = _post(srv, {"input": "w5", "dimensions": dims})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
    for route, body in (("completions", {"prompt": "w5"}),
                        ("chat/completions", {"messages": [{"role": "user", "content": "w5"}]})):
        r = httpx.post(f"{srv.url}/v1/{route}", json={"model": MODEL_NAME, **body}, timeout=30)
        assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"]
    models = httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [MODEL_NAME]
    assert wait_kv_free(srv.url)["num_free_blocks"] == 32


def test_generation_server_refuses_embeddings():
    http = app_client(ScriptedEngine(["w9"]))
    r = http.post("/v1/embeddings", json={"model": "m", "input": "w5"})
    assert r.status_code == 400 and "generation model" in r.json()["error"]["message"]
    assert http.post("/v1/completions", json={"model": "m", "prompt": "w5"}).status_code == 200


def test_cli_flags():
    import argparse

    from jaxserve.config import ConfigError, EngineArgs
    from jaxserve.cli_args import add_cli_args, engine_args_from_cli
    p = argparse.ArgumentParser()
    add_cli_args(p)
    a = engine_args_from_cli(p.parse_args(["--task", "embed", "--pooler-config",
                                           '{"pooling_type": "MEAN", "normalize": false}']))
    assert a.task == "embed" and a.pooler_config == {"pooling_type": "MEAN",
                                                     "normalize": False}
    assert EngineArgs().task == "auto"
    with pytest.raises(ConfigError, match="pooling_type"):
        EngineArgs(pooler_config={"pooling_type": "CLS"})
