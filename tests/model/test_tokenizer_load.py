"""How a checkpoint's tokenizer is loaded (jaxserve.model.tokenizer.load) and how
`jaxserve serve` defers it: the generic fast class read directly where the checkpoint's
config names it (no AutoTokenizer, no torch import), the same tokens and chat text as
AutoTokenizer; a BackgroundTokenizer that loads once, only when started, re-raises its
load's error, and that the engine starts when its warm-up starts (real `jaxserve serve`
processes serve grammars through one: tests/tools/test_stress_short.py)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading

import pytest
import transformers

from jaxserve.model.loader.default_model import default_model_path
from jaxserve.model.tokenizer import load as tok_load
from jaxserve.model.tokenizer.load import (BackgroundTokenizer, load_tokenizer, resolved,
                                           start_loading)

TEXTS = ["", "Hello, world! How are you?", "日本語のテキスト 😀👍🏽 café",
         "<|im_start|>user\nWhat is 2+2?<|im_end|>\n", "a  b\t\tc\r\n 3.14159 1,000,000"]
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello! 你好\n\tcode: `x = 1`"}]


@pytest.fixture(scope="module")
def model_dir():
    return default_model_path()


def _config_class(path) -> str:
    return json.loads((path / "tokenizer_config.json").read_text())["tokenizer_class"]


def test_generic_class_read_directly_and_equal_to_auto(model_dir, monkeypatch):
    assert _config_class(model_dir) in tok_load.GENERIC_FAST
    want = transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)

    def no_auto(*a, **k):
        raise AssertionError("AutoTokenizer used for a generic fast tokenizer")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_auto)
    got = load_tokenizer(model_dir)
    assert got.is_fast and got.chat_template == want.chat_template
    assert got.eos_token_id == want.eos_token_id and len(got) == len(want)
    for text in TEXTS:
        for specials in (True, False):
            assert got.encode(text, add_special_tokens=specials) == \
                want.encode(text, add_special_tokens=specials), text
    for gen in (True, False):
        assert got.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen) == \
            want.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen)


def test_a_named_class_goes_through_auto(model_dir, tmp_path, monkeypatch):
    d = tmp_path / "tok"
    shutil.copytree(model_dir, d, ignore=shutil.ignore_patterns("*.safetensors*"))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "GPT2Tokenizer"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    calls = []
    auto = transformers.AutoTokenizer.from_pretrained

    def recording(*a, **k):
        calls.append(a[0])
        return auto(*a, **k)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", recording)
    tok = load_tokenizer(d)
    assert calls == [str(d)]
    assert tok.encode("Hello, world!") == load_tokenizer(model_dir).encode("Hello, world!")


def test_generic_load_does_not_import_torch(model_dir):
    # the test extra installs torch; AutoTokenizer's auto classes import it
    code = ("import sys; from jaxserve.model.tokenizer.load import load_tokenizer; "
            f"t = load_tokenizer({str(model_dir)!r}); "
            "print(t.encode('Hello world'), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    ids = load_tokenizer(model_dir).encode("Hello world")
    assert out.stdout.strip().splitlines()[-1] == f"{ids} False"


def test_background_tokenizer_loads_once_when_started():
    calls, gate = [], threading.Event()

    def load():
        calls.append(1)
        gate.wait(10)
        return "the tokenizer"
    bt = BackgroundTokenizer(load)
    assert calls == []              # nothing runs before start
    start_loading(bt)
    start_loading(bt)
    gate.set()
    assert resolved(bt) == "the tokenizer" and bt.result() == "the tokenizer"
    assert calls == [1]
    assert resolved("plain") == "plain" and resolved(None) is None
    start_loading(None)             # anything else is left alone


def test_background_tokenizer_reraises_the_load_error():
    def load():
        raise ValueError("no tokenizer here")
    bt = BackgroundTokenizer(load)   # result() starts it when nothing did
    with pytest.raises(ValueError, match="no tokenizer here"):
        resolved(bt)


def test_engine_starts_it_at_warmup():
    from engine_utils import tiny_config, tiny_tokenizer, tiny_weights
    from jaxserve.config import EngineArgs
    from jaxserve.core.engine_core import EngineCore
    started = []

    def load():
        started.append(threading.current_thread().name)
        return tiny_tokenizer()
    bt = BackgroundTokenizer(load)
    cfg = tiny_config()
    args = EngineArgs(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
                      token_buckets=[8, 16], num_kv_blocks=8)
    core = EngineCore(args, cfg, tiny_weights(cfg), progress=False, tokenizer=bt)
    assert len(started) == 1 and started[0].startswith("tokenizer")   # by the warm-up
    assert core.scheduler.grammar is not None      # structured outputs served
    assert bt.result().vocab_size == tiny_tokenizer().vocab_size and len(started) == 1
