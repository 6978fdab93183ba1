"""Step programs kept on disk as exported modules (worker/executables.py): a second engine
with the same settings loads every step program instead of tracing it, and draws the same
tokens; corrupt, foreign or mismatched entries are ignored and exported again; the
result structures round-trip through the JSON codec."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine_utils import random_prompts, tiny_config, tiny_tokenizer, tiny_weights
from jaxserve import SamplingParams as SP
from jaxserve.frontend.llm import LLM
from jaxserve.worker import executables, step_config as step_config_mod

ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
              token_buckets=[8, 32])
PARAMS = [SP(max_tokens=5, temperature=0, ignore_eos=True),
          SP(max_tokens=5, temperature=0.9, top_p=0.9, seed=3, logprobs=2, ignore_eos=True)]

pytestmark = pytest.mark.warmup


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config()
    return cfg, tiny_weights(cfg), tiny_tokenizer()


@pytest.fixture
def store_dir(tmp_path, monkeypatch) -> Path:
    """The store under tmp_path (XLA's persistent cache stays where it is)."""
    monkeypatch.setenv(executables.ENV, "1")
    monkeypatch.setattr(executables, "cache_root", lambda root=None: tmp_path)
    return tmp_path / "executables"


def _llm(model, **kw) -> LLM:
    cfg, w, tok = model
    return LLM.from_weights(cfg, w, tok, **{**ENGINE, **kw})


def _run(llm: LLM) -> list:
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 128, 3, 20, seed=1)]
    outs = llm.generate(prompts, [PARAMS[i % 2] for i in range(4)], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _files(store_dir: Path) -> list[Path]:
    return sorted(store_dir.glob("*/*.jexp"))


@pytest.mark.parametrize("gpu_form", [pytest.param(False, marks=pytest.mark.slow), True])
def test_second_engine_loads_every_step_program(model, store_dir, monkeypatch, gpu_form):
    """CPU: the hybrid step (fused small buckets, layerwise above); GPU form: the fused
    forward programs and the branch-free sampler."""
    kw = {}
    if gpu_form:
        monkeypatch.setattr(step_config_mod, "step_platform", lambda plan: "gpu")
        kw = dict(step_mode="fused")
    first = _llm(model, **kw)
    store = first.engine.runner.executables
    assert store is not None and store.saved > 0 and store.loaded == 0
    assert first.num_compiles > 0
    files = _files(store_dir)
    assert len(files) == store.saved
    assert all(os.stat(f).st_mode & 0o077 == 0 for f in files)
    want = _run(first)
    second = _llm(model, **kw)
    again = second.engine.runner.executables
    assert again is not None and again.dir == store.dir
    assert second.num_compiles == 0, "a second start compiled step programs"
    assert again.loaded == store.saved and again.saved == 0
    assert _run(second) == want
    assert second.num_compiles == 0, "compiled after warm-up"
    monkeypatch.setenv(executables.ENV, "0")            # jit's own programs draw the same
    plain = _llm(model, **kw)
    assert plain.engine.runner.executables is None and _run(plain) == want


def test_bad_entries_are_ignored(model, store_dir, caplog):
    first = _llm(model, decode_steps=1)
    want = _run(first)
    files = _files(store_dir)
    assert len(files) >= 3
    files[0].write_bytes(files[0].read_bytes()[:100])           # truncated
    files[1].write_bytes(files[2].read_bytes())                 # another program's entry
    os.chmod(files[2], 0o666)                                   # writable by others
    second = _llm(model, decode_steps=1)
    store = second.engine.runner.executables
    assert store is not None and store.loaded == len(files) - 3
    assert 0 < second.num_compiles
    assert _run(second) == want
    # the truncated entry was removed, exported again and stored again
    assert files[0].stat().st_size > 100
    assert any("unusable" in r.message for r in caplog.records)
    assert any("not private" in r.message for r in caplog.records)


def test_other_settings_get_another_directory(store_dir):
    a = executables.ExecutableStore({"max_logprobs": 20})
    b = executables.ExecutableStore({"max_logprobs": 3})
    assert a.dir != b.dir and a.dir.parent == b.dir.parent == store_dir
    assert executables.ExecutableStore({"max_logprobs": 20}).dir == a.dir
    assert (a.dir / "meta.json").is_file() and a.dir.stat().st_mode & 0o077 == 0


@pytest.mark.parametrize("value", [None, "0"])
def test_on_by_default_and_off_switch(model, store_dir, monkeypatch, value):
    if value is None:
        monkeypatch.delenv(executables.ENV)
    else:
        monkeypatch.setenv(executables.ENV, value)
    cfg, w, tok = model
    llm = LLM.from_weights(cfg, w, tok, **{**ENGINE, "token_buckets": [8]}, decode_steps=1)
    if value is None:
        assert llm.engine.runner.executables is not None and _files(store_dir)
    else:
        assert llm.engine.runner.executables is None and not store_dir.exists()


def test_no_pickle_in_the_store(model, store_dir, monkeypatch):
    """Writing and reading entries never goes through pickle."""
    import pickle

    def refuse(*a, **k):
        raise AssertionError("pickle used")
    for name in ("dumps", "loads", "dump", "load"):
        monkeypatch.setattr(pickle, name, refuse)
    first = _llm(model, decode_steps=1, token_buckets=[8])
    second = _llm(model, decode_steps=1, token_buckets=[8])
    assert second.engine.runner.executables.loaded == first.engine.runner.executables.saved > 0


def test_tree_codec_round_trip():
    """The result structures of the step programs: builtins, jaxserve's node types and a
    packed Layout nesting a PyTreeDef; a foreign node type is refused."""
    import collections

    import jax
    import numpy as np

    from jaxserve.sampling.sampler import SamplerOutput
    from jaxserve.worker import tree_codec
    from jaxserve.worker.packing import pack
    packed = pack(batch=(np.zeros(3, np.int32), {"a": np.ones(2, np.float32), "b": None}),
                  sampling=SamplerOutput(*(np.zeros(2, np.int32),) * 4))
    tree = (packed, [SamplerOutput(1, 2, 3, 4), None], {"x": (1, 2)})
    td = jax.tree_util.tree_structure(tree)
    back = tree_codec.decode(__import__("json").loads(__import__("json").dumps(
        tree_codec.encode(td))))
    assert back == td
    assert back.node_data()[1] is None and back.children()[0].node_data()[1] == (packed.layout,)
    Pair = collections.namedtuple("Pair", "a b")
    with pytest.raises(tree_codec.Unencodable):
        tree_codec.encode(jax.tree_util.tree_structure(Pair(1, 2)))
    with pytest.raises(tree_codec.Unencodable):
        tree_codec.decode(["os:system", None, []])


def test_old_fingerprints_are_pruned(store_dir, monkeypatch):
    import time
    monkeypatch.setattr(executables, "KEEP", 2)
    dirs = []
    for i in range(4):
        dirs.append(executables.ExecutableStore({"n": i}).dir)
        time.sleep(0.02)
    assert [d.exists() for d in dirs] == [False, False, True, True]


def test_a_stored_module_that_does_not_compile_falls_back(model, store_dir, monkeypatch,
                                                          caplog):
    """A stored module that fails to compile in this process (say, a kernel it calls was
    not registered) is compiled from the source instead: the engine still starts and
    draws the same tokens."""
    first = _llm(model, decode_steps=1)
    want = _run(first)

    def broken(self, entry, args):
        raise RuntimeError("custom call target not found")
    monkeypatch.setattr(executables.Loaded, "__init__", broken)
    second = _llm(model, decode_steps=1)
    assert second.engine.runner.executables.loaded > 0 and second.num_compiles > 0
    assert _run(second) == want
    assert any("does not compile here" in r.message for r in caplog.records)
