"""The Rust DecodeStream path of IncrementalDetokenizer emits exactly what the Python
path (the fallback, the pre-DecodeStream code) emits, step by step: multilingual text,
byte-fallback tokens, special tokens, skip_special_tokens on and off, one and several
tokens per step; plus when each path is taken."""
from __future__ import annotations

import random

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers

from engine_utils import tiny_tokenizer
from jaxserve.frontend.detokenizer import IncrementalDetokenizer

TEXT = ("Hello wörld! 日本語のテキスト 🤖🎉 Ελληνικά русский  \n\t مرحبا "
        "naïve café — “quotes” and ∑∫ math; the end.")


def byte_fallback_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A Llama/Mistral-style SentencePiece BPE: '▁' for spaces, <0xXX> byte tokens for
    characters outside the vocab, a decoder that strips the leading space (so decoding
    depends on context, as with the real ones)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in "▁abcdefghijklmnopqrstuvwxyzHTW!.,;'":
        vocab[c] = len(vocab)
    merges = []
    for word in ("▁the", "▁hello", "▁world", "▁end", "▁and"):
        for i in range(2, len(word) + 1):
            left, right = word[:i - 1], word[i - 1]
            if word[:i] not in vocab:
                merges.append((left, right))
                vocab[word[:i]] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                                bos_token="<s>", eos_token="</s>")


def smollm_tokenizer() -> transformers.PreTrainedTokenizerFast:
    from jaxserve.model.loader.default_model import default_model_path
    from jaxserve.model.tokenizer.load import load_tokenizer
    return load_tokenizer(default_model_path())


TOKENIZERS = {"byte_fallback": byte_fallback_tokenizer, "smollm2": smollm_tokenizer,
              "wordlevel": lambda: tiny_tokenizer(128)}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tok(request):
    return TOKENIZERS[request.param]()


def _deltas(tok, prompt: list[int], ids: list[int], skip: bool, stream: bool,
            chunk: int = 1) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, prompt, skip, use_stream=stream)
    assert d.uses_stream == stream
    return [d.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)], d


def _sequences(tok) -> list[list[int]]:
    """The text's tokens, the same with special tokens spliced in, and random ids."""
    text_ids = tok.encode(TEXT, add_special_tokens=False)
    specials = [i for i in tok.all_special_ids if i is not None]
    with_specials = list(text_ids)
    for k, pos in enumerate(range(3, len(with_specials), 11)):
        with_specials.insert(pos, specials[k % len(specials)])
    rng = random.Random(0)
    randoms = [[rng.randrange(len(tok)) for _ in range(60)] for _ in range(8)]
    return [text_ids, with_specials, *randoms]


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("chunk", [1, 3])
def test_stream_matches_python_path(tok, skip, chunk):
    prompt = tok.encode("the hello world, and", add_special_tokens=True)
    for ids in _sequences(tok):
        want, py = _deltas(tok, prompt, ids, skip, stream=False, chunk=chunk)
        got, rs = _deltas(tok, prompt, ids, skip, stream=True, chunk=chunk)
        assert got == want
        assert rs.text == py.text


def test_byte_fallback_text_round_trips():
    """Independent truth: the streamed text of a text's tokens is the text itself
    (characters outside the vocab come as <0xXX> pieces and must be reassembled)."""
    tok = byte_fallback_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert any(tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids)
    deltas, d = _deltas(tok, tok.encode("the end", add_special_tokens=False), ids,
                        True, stream=True)
    # The prompt's context keeps the first token's leading space, as in the text.
    assert d.text == " " + TEXT
    # No delta ever ends inside a character.
    assert all("\ufffd" not in x for x in deltas)


def test_special_tokens_follow_skip_flag():
    tok = smollm_tokenizer()
    ids = tok.encode("hi<|im_end|> there", add_special_tokens=False)
    _, kept = _deltas(tok, [], ids, False, stream=True)
    _, skipped = _deltas(tok, [], ids, True, stream=True)
    assert kept.text == "hi<|im_end|> there"
    assert skipped.text == "hi there"


def test_prompt_tail_inside_a_character_uses_python_path():
    tok = byte_fallback_tokenizer()
    ids = tok.encode("日本", add_special_tokens=False)      # 6 byte tokens
    prompt, rest = ids[:2], ids[2:]                         # prompt ends mid-character
    d = IncrementalDetokenizer(tok, prompt, True)
    assert not d.uses_stream
    want, _ = _deltas(tok, prompt, rest, True, stream=False)
    assert [d.add([t]) for t in rest] == want


def test_decode_override_uses_python_path():
    class Custom(transformers.PreTrainedTokenizerFast):
        def decode(self, *a, **kw):     # type: ignore[override]
            return super().decode(*a, **kw).upper()

    base = tiny_tokenizer(128)
    tok = Custom(tokenizer_object=base.backend_tokenizer, unk_token="<unk>")
    d = IncrementalDetokenizer(tok, [5], True)
    assert not d.uses_stream
    assert d.add([6, 7]) == " W6 W7"


def test_stream_failure_switches_to_python_path_mid_sequence():
    tok = smollm_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    prompt = tok.encode("Say something:")
    want, _ = _deltas(tok, prompt, ids, True, stream=False)
    d = IncrementalDetokenizer(tok, prompt, True)
    got = [d.add([t]) for t in ids[:7]]

    class Broken:
        def step(self, *_a):
            raise Exception("Invalid prefix encountered")
    d._stream = Broken()
    got += [d.add([t]) for t in ids[7:]]
    assert not d.uses_stream
    assert got == want


def test_no_tokenizer_gives_empty_text():
    d = IncrementalDetokenizer(None, [1, 2, 3], True)
    assert d.add([4, 5]) == "" and d.text == ""
