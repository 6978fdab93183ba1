"""GGUF tokenizers built without torch (jaxserve.model.tokenizer.gguf).

Truths: transformers' own GGUF tokenizer (AutoTokenizer(..., gguf_file=...), which needs
torch and is a test-only reference) reading the same file; for the "smollm" pre-tokenizer,
which transformers does not know, llama.cpp's split regexes (llama-vocab.cpp) applied
with the `regex` package. Files: the embedded default model's GGUF (byte-level BPE), the
same vocabulary re-written with other pre-tokenizers, and a SentencePiece-style "llama"
vocabulary (scores, byte fallback, control and user-defined tokens) written here.
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import regex
from tokenizers import SentencePieceBPETokenizer, pre_tokenizers
from transformers import AutoTokenizer

from jaxserve.deps import MissingDependencyError
from jaxserve.model.tokenizer.gguf import load_gguf_tokenizer, read_vocab, spm_merges
from jaxserve.model.loader.default_model import default_gguf_path
from jaxserve.model.loader.errors import CheckpointError
from jaxserve.model.tokenizer.load import load_tokenizer

TEXTS = [
    "",
    "Hello, world! How are you?",
    "日本語のテキスト、中文字符，한국어 문장입니다。",
    "مرحبا بالعالم، كيف حالك؟",
    "Emoji: 😀👍🏽🎉 and a family 👨\u200d👩\u200d👧 ✓",
    "Accents: café naïve façade Ångström ñandú über Ελληνικά Ёжик",
    "I'm sure you're right; it's theirs, they'll say. DON'T we'd've?",
    'def f(x):\n    return {"a": [1, 2, 3]}  # comment\n\tif x != y: print(x ** 2)\n',
    "a  b   c    d     e", "\t\ttabs\tand  spaces \t mixed", "line1\nline2\n\n\nline3\n",
    "windows\r\nline\r\n\r\nend", "   leading", "trailing   ", " ", "\n", "\r\n",
    "3.14159 1234567890, year 2024: 1,000,000 and x2 abc  1  22   333",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|endoftext|> <|im_end|>",
    "<s>[INST] hi [/INST] there</s> <tool>call</tool> <unk>",
]
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello! 你好 2024\n\tcode: `x = 1`"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Bye  now"}]
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM: every digit alone, then GPT-2's regex.
LLAMA_CPP_SMOLLM = [r"\p{N}",
                    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"]


def reference(path: Path):
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                         local_files_only=True)


def assert_same_ids(ours, ref, texts=TEXTS) -> None:
    for text in texts:
        for specials in (True, False):
            want = ref.encode(text, add_special_tokens=specials)
            got = ours.encode(text, add_special_tokens=specials)
            assert got == want, (text, specials, ours.convert_ids_to_tokens(got),
                                 ref.convert_ids_to_tokens(want))
        ids = ours.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert (ours.decode(ids, skip_special_tokens=skip)
                    == ref.decode(ids, skip_special_tokens=skip)), text


def assert_same_chat(ours, ref) -> None:
    assert ours.chat_template == ref.chat_template is not None
    for gen in (True, False):
        want = ref.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=gen)
        got = ours.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=gen)
        assert list(got["input_ids"] if isinstance(got, dict) else got) == list(
            want["input_ids"] if isinstance(want, dict) else want)


def write_tokenizer_gguf(path: Path, meta: dict) -> Path:
    """A GGUF with tokenizer metadata and a tiny llama config, no tensors (neither
    tokenizer reads them)."""
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 64),
                       (w.add_embedding_length, 8), (w.add_feed_forward_length, 16),
                       (w.add_head_count, 2), (w.add_head_count_kv, 2),
                       (w.add_layer_norm_rms_eps, 1e-6), (w.add_vocab_size, len(meta["tokens"]))):
        add(value)
    w.add_tokenizer_model(meta["model"])
    for key, add in (("pre", w.add_tokenizer_pre), ("tokens", w.add_token_list),
                     ("types", w.add_token_types), ("scores", w.add_token_scores),
                     ("merges", w.add_token_merges), ("bos", w.add_bos_token_id),
                     ("eos", w.add_eos_token_id), ("unk", w.add_unk_token_id),
                     ("pad", w.add_pad_token_id), ("add_bos", w.add_add_bos_token),
                     ("add_eos", w.add_add_eos_token), ("space", w.add_add_space_prefix),
                     ("chat_template", w.add_chat_template)):
        if meta.get(key) is not None:
            add(meta[key])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ------------------------------------------------------------ byte-level BPE ("gpt2")

@pytest.fixture(scope="module")
def default_pair():
    path = default_gguf_path()
    return path, load_gguf_tokenizer(path), reference(path)


def test_default_gguf_matches_transformers(default_pair):
    path, ours, ref = default_pair
    ref = copy.deepcopy(ref)
    assert read_vocab(path).pre == "smollm"
    # SmolLM2's own tokenizer.json splits digits before GPT-2's regex; transformers' GGUF
    # path does not know "smollm" and drops that step, so the reference gets it back.
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    assert_same_ids(ours, ref)
    assert_same_chat(ours, ref)
    assert (ours.bos_token_id, ours.eos_token_id, ours.unk_token_id, ours.pad_token_id) == \
        (ref.bos_token_id, ref.eos_token_id, ref.unk_token_id, ref.pad_token_id) == (1, 2, 0, 2)
    ids = ours.encode(TEXTS[5] + TEXTS[7], add_special_tokens=False)
    assert ours.decode(ids) == TEXTS[5] + TEXTS[7]


def _llama_cpp_split(text: str) -> list[str]:
    pieces = [text]
    for pattern in LLAMA_CPP_SMOLLM:   # each regex splits the pieces the previous left
        pieces = [p for piece in pieces for p in _split_keep(pattern, piece)]
    return pieces


def _split_keep(pattern: str, text: str) -> list[str]:
    out, pos = [], 0
    for m in regex.finditer(pattern, text):
        out += [text[pos:m.start()], m.group()]
        pos = m.end()
    return [p for p in [*out, text[pos:]] if p]


def test_smollm_pre_tokenizer_follows_llama_cpp(default_pair):
    _, ours, plain = default_pair   # BPE alone on one llama.cpp piece is the truth
    for text in TEXTS:
        if "<" in text:
            continue   # special tokens are matched before pre-tokenizing: covered above
        want = [i for piece in _llama_cpp_split(text)
                for i in plain.encode(piece, add_special_tokens=False)]
        assert ours.encode(text, add_special_tokens=False) == want, text
    # where transformers' GGUF path differs: two spaces before a digit
    assert ours.tokenize("abc  1") == ["abc", "ĠĠ", "1"]
    assert plain.tokenize("abc  1") == ["abc", "Ġ", "Ġ", "1"]


@pytest.fixture(scope="module")
def small_bpe_vocab() -> dict:
    """The default model's first 8000 tokens and the merges among them (small files
    parse fast; every byte and every special token is among them)."""
    r = gguf.GGUFReader(str(default_gguf_path()))
    tokens, types, merges = (r.fields[f"tokenizer.ggml.{k}"].contents()
                             for k in ("tokens", "token_type", "merges"))
    tokens, types = tokens[:8000], types[:8000]
    keep = set(tokens)
    merges = [m for m in merges if all(p in keep for p in (*m.split(" "), m.replace(" ", "")))]
    assert len(merges) > 7000
    return {"model": "gpt2", "tokens": tokens, "types": types, "merges": merges, "bos": 1,
            "eos": 2}


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_gpt2_pre_tokenizers_match_transformers(tmp_path, small_bpe_vocab, pre):
    """A byte-level vocabulary under the split regexes of other model families."""
    path = write_tokenizer_gguf(tmp_path / f"{pre}.gguf", {
        **small_bpe_vocab, "pre": pre, "add_bos": pre == "llama-bpe"})
    ours, ref = load_gguf_tokenizer(path), reference(path)
    assert json.loads(ours.backend_tokenizer.to_str())["pre_tokenizer"] == \
        json.loads(ref.backend_tokenizer.to_str())["pre_tokenizer"]
    assert_same_ids(ours, ref)
    assert (ours.encode("hi")[0] == 1) == (pre == "llama-bpe")   # add_bos_token honoured


# ------------------------------------------------------ SentencePiece-style ("llama")

SPM_CORPUS = ["Hello world, how are you doing today? The quick brown fox jumps over the lazy dog.",
              "café naïve façade résumé über", "def main():\n    return 0\n",
              "Il était une fois une petite fille.", "numbers 123 456 7890"]
SPM_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
                "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


def spm_meta(space: bool | None = None) -> dict:
    """<unk> <s> </s>, the 256 byte-fallback tokens, a control and a user-defined token,
    then pieces learned from a small corpus scored best-first as SentencePiece does."""
    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(SPM_CORPUS * 3, vocab_size=300, min_frequency=1, show_progress=False)
    learned = [p for p, _ in sorted(sp.get_vocab().items(), key=lambda kv: kv[1])
               if p != "<unk>"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "[INST]", "<tool>"]
    types = [2, 3, 3, *[6] * 256, 3, 4]
    scores = [0.0] * len(tokens)
    for rank, piece in enumerate(learned):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank // 4))   # ties in fours: the tie-break rule matters
    return {"model": "llama", "tokens": tokens, "types": types, "scores": scores,
            "bos": 1, "eos": 2, "unk": 0, "space": space, "chat_template": SPM_TEMPLATE}


def test_spm_gguf_matches_transformers(tmp_path):
    path = write_tokenizer_gguf(tmp_path / "spm.gguf", spm_meta())
    ours, ref = load_gguf_tokenizer(path), reference(path)
    assert_same_ids(ours, ref)
    assert_same_chat(ours, ref)
    assert ours.add_bos_token and ours.encode("x")[0] == 1   # llama.cpp's default for SPM
    # characters outside the vocabulary fall back to their UTF-8 bytes, and decode back
    ids = ours.encode("é😀", add_special_tokens=False)
    assert ours.convert_ids_to_tokens(ids)[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert ours.decode(ids) == "é😀"
    # the user-defined token is matched whole inside text, with its own id
    tool = ours.convert_tokens_to_ids("<tool>")
    assert tool == spm_meta()["tokens"].index("<tool>")
    assert ours.encode("a<tool>b", add_special_tokens=False).count(tool) == 1


def test_spm_merges_match_transformers():
    """Merges rebuilt from scores, order included (ties decide which pair merges first)."""
    from transformers.tokenization_utils_base import generate_merges

    meta = spm_meta()
    tokens, scores = meta["tokens"], meta["scores"]
    want = generate_merges({t: i for i, t in enumerate(tokens)}, dict(zip(tokens, scores)))
    assert len(want) > 100 and spm_merges(tokens, scores) == want


def test_spm_without_space_prefix(tmp_path):
    """add_space_prefix = false (transformers ignores it; llama.cpp honours it)."""
    path = write_tokenizer_gguf(tmp_path / "spm.gguf", spm_meta(space=False))
    ours = load_gguf_tokenizer(path)
    with_prefix = load_gguf_tokenizer(write_tokenizer_gguf(tmp_path / "p.gguf", spm_meta()))
    assert not ours.tokenize("Hello world")[0].startswith("▁")
    assert with_prefix.tokenize("Hello world")[0].startswith("▁")
    for text in TEXTS[1:8]:
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == text


# ----------------------------------------------------------------- errors, no torch

def test_unsupported_tokenizer_model(tmp_path):
    path = write_tokenizer_gguf(tmp_path / "t5.gguf", {**spm_meta(), "model": "t5"})
    with pytest.raises(CheckpointError, match=r"unsupported GGUF tokenizer model 't5'") as e:
        load_tokenizer(tmp_path, gguf_file="t5.gguf")
    assert "\n" not in str(e.value)


def test_missing_jinja2_is_one_line(tmp_path, monkeypatch):
    write_tokenizer_gguf(tmp_path / "spm.gguf", spm_meta())   # it has a chat template
    monkeypatch.setitem(sys.modules, "jinja2", None)   # `import jinja2` now fails
    with pytest.raises(MissingDependencyError, match="'jinja2'.*pip install") as e:
        load_tokenizer(tmp_path, gguf_file="spm.gguf")
    assert "\n" not in str(e.value)


# torch is installed in the test venv; hide it the way a runtime install lacks it: every
# import finder answers "not found" for it (a finder that raised instead would break
# transformers' availability probe, which a missing package does not).
NO_TORCH = """
import sys
class Hide:
    def __init__(self, inner):
        self.inner = inner
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            return None
        return self.inner.find_spec(name, path, target)
    def __getattr__(self, attr):
        return getattr(self.inner, attr)
sys.meta_path[:] = [Hide(f) for f in sys.meta_path]
try:
    import torch
    raise SystemExit("torch is still importable")
except ModuleNotFoundError:
    pass
from jaxserve.model.loader.default_model import default_gguf_path
from jaxserve.model.tokenizer.load import load_tokenizer
p = default_gguf_path()
tok = load_tokenizer(p.parent, gguf_file=p.name)
ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
print(tok.encode("Hello world 2024"), "torch" in sys.modules)
"""


def test_loads_default_tokenizer_without_torch(default_pair):
    _, ours, _ = default_pair
    out = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == f"{ours.encode('Hello world 2024')} False"
