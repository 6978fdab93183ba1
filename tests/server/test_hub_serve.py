"""`jaxserve serve <repo id>` end to end, offline: the CLI resolves the repo id in a
Hugging Face cache laid out in tmp (models--org--name/snapshots/<hash>/, refs/main),
loads the tiny checkpoint, builds and warms up a small engine, and serves the model
under the repo id. Only run_server (bind a port, block in uvicorn) is replaced: the
app it would serve is built the same way (build_app with the launch's name) and
asked over HTTP in-process."""
from __future__ import annotations

from typing import Any

from starlette.testclient import TestClient

from jaxserve.cli import main
from jaxserve.server import launch
from server_harness import save_tiny_checkpoint

REPO = "tiny-org/tiny-llama"
HASH = "0123456789abcdef0123456789abcdef01234567"
SMALL_FLAGS = ["--max-model-len", "128", "--token-buckets", "16",
               "--max-num-batched-tokens", "16", "--max-num-seqs", "4",
               "--block-size", "16", "--num-kv-blocks", "32"]


def test_serve_by_repo_id_names_the_model_by_it(tmp_path, monkeypatch):
    repo = tmp_path / f"models--{REPO.replace('/', '--')}"
    save_tiny_checkpoint(repo / "snapshots" / HASH)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HASH)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)             # no local "tiny-org/tiny-llama" path
    seen: dict[str, Any] = {}

    def run_server(engine: Any, tokenizer: Any, args: Any, name: str) -> int:
        from jaxserve.server.api import build_app
        seen["name"], seen["max_model_len"] = name, engine.max_model_len
        try:
            with TestClient(build_app(engine, tokenizer, model_name=name, args=args)) as http:
                seen["models"] = http.get("/v1/models")
                seen["completion"] = http.post("/v1/completions", json={
                    "model": REPO, "prompt": "w5 w6", "max_tokens": 4, "temperature": 0})
                seen["other"] = http.post("/v1/completions", json={
                    "model": "tiny-llama", "prompt": "w5", "max_tokens": 1})
        finally:
            engine.close()
        return 0

    monkeypatch.setattr(launch, "run_server", run_server)
    assert main(["serve", REPO, *SMALL_FLAGS]) == 0
    assert seen["name"] == REPO and seen["max_model_len"] == 128
    models = seen["models"]
    assert models.status_code == 200, models.text
    assert [m["id"] for m in models.json()["data"]] == [REPO]
    r = seen["completion"]
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == REPO and body["usage"]["completion_tokens"] == 4
    assert body["choices"][0]["text"].split()[0].startswith("w")    # the tiny vocabulary
    # only the served name is a model here
    assert seen["other"].status_code == 404, seen["other"].text
