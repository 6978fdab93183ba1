"""Models named by Hugging Face repo id: resolved offline from a Hugging Face cache laid
out in tmp (models--org--name/snapshots/<hash>/, refs/main) holding the tiny checkpoint;
a repo id that is not cached is one error line at the CLI; several served names."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxserve.cli import build_parser, main
from jaxserve.cli_args import engine_args
from jaxserve.config import EngineArgs
from jaxserve.model.loader.load import load_model
from jaxserve.model.loader.hub import is_repo_id
from jaxserve.server.launch import model_name
from server_harness import save_tiny_checkpoint

REPO = "tiny-org/tiny-llama"
HASH = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory) -> Path:
    """A Hugging Face hub cache holding REPO at HASH (refs/main -> HASH)."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / f"models--{REPO.replace('/', '--')}"
    snap = repo / "snapshots" / HASH
    save_tiny_checkpoint(snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(HASH)
    return cache


def test_repo_id_loads_offline_from_the_cache(hf_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_cache))
    loaded = load_model(REPO)
    assert Path(loaded.source).name == HASH and loaded.format == "safetensors"
    assert loaded.config.vocab_size == 128
    assert loaded.tokenizer.encode("w5 w6", add_special_tokens=False) == [5, 6]
    # the same weights as the checkpoint directory itself
    direct = load_model(str(hf_cache / f"models--{REPO.replace('/', '--')}" / "snapshots"
                            / HASH))
    np.testing.assert_array_equal(np.asarray(loaded.weights["embed"]),
                                  np.asarray(direct.weights["embed"]))
    assert model_name(EngineArgs(model=REPO)) == REPO          # served under the repo id


def test_uncached_repo_is_one_line_at_the_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert main(["serve", "tiny-org/not-cached"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("jaxserve: error: model 'tiny-org/not-cached'") and \
        "HF_HUB_OFFLINE" in err and str(tmp_path) in err, err


def test_served_model_names(tmp_path):
    ns = build_parser().parse_args(["serve", REPO, "--served-model-name", "a", "b"])
    args = engine_args(ns)
    assert args.served_model_name == ["a", "b"] and model_name(args) == "a"
    assert EngineArgs(served_model_name="one").served_model_name == ["one"]
    (tmp_path / "c.yaml").write_text("served_model_name: solo\n")
    assert EngineArgs.from_sources(tmp_path / "c.yaml").served_model_name == ["solo"]
    assert model_name(EngineArgs(model=str(tmp_path))) == tmp_path.name


@pytest.mark.parametrize("text, repo", [
    ("org/name", True), ("name", True), ("org/name@v1.0", True), ("org/na.me-x_1", True),
    ("./name", False), ("/abs/dir", False), ("a/b/c", False), ("model.gguf", False),
    ("~/models/x", False), ("../x", False)])
def test_what_counts_as_a_repo_id(text, repo):
    assert is_repo_id(text) is repo


def test_an_existing_path_is_never_a_repo_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_repo_id("org/name")
