"""A GGUF file's tokenizer, built from its metadata with `tokenizers` alone (no torch).

transformers' own GGUF tokenizer path imports torch, which the runtime install lacks.
A GGUF carries everything a fast tokenizer needs, under llama.cpp's key names:

    tokenizer.ggml.model        "gpt2" (byte-level BPE) or "llama" (SentencePiece-style)
    tokenizer.ggml.pre          which pre-tokenizer split the merges were learned with
    tokenizer.ggml.tokens       the vocabulary, in id order
    tokenizer.ggml.token_type   1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte
    tokenizer.ggml.merges       BPE merges ("a b"); SentencePiece files have scores instead
    tokenizer.ggml.scores       per-token scores (SentencePiece: higher merges first)
    tokenizer.ggml.{bos,eos,unknown,padding}_token_id, add_bos_token, add_eos_token,
    add_space_prefix, and tokenizer.chat_template.

Token ids match transformers' GGUF tokenizer, except where transformers ignores what the
file says and we follow llama.cpp, which wrote it: pre-tokenizers transformers does not
know (e.g. "smollm", which splits digits first) and add_space_prefix = false.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jaxserve.model.loader.errors import CheckpointError
from jaxserve.model.loader.gguf_file import field, open_gguf

log = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4
SPIECE_SPACE = "\u2581"
SUPPORTED_MODELS = ("gpt2", "llama")

# Split regexes, as the models' tokenizer.json files (and llama.cpp) define them.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_REGEXES = {**dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx",
                                  "falcon3"), _LLAMA3),
                 **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2),
                 **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O)}
# Each digit alone, then GPT-2's regex (llama.cpp's STARCODER/SMOLLM family).
DIGIT_THEN_GPT2 = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone"}
# GPT-2's own regex (tokenizers' ByteLevel default).
GPT2_REGEX = {"default", "gpt-2", "gpt2", "mpt", "olmo", "jais"}


@dataclass(slots=True)
class GGUFVocab:
    """The tokenizer metadata of one GGUF file."""
    model: str
    pre: str | None
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    special_ids: dict[str, int | None]        # bos/eos/unk/pad -> id
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None


def read_vocab(path: Path) -> GGUFVocab:
    reader = open_gguf(path)
    model = field(reader, "tokenizer.ggml.model")
    if model not in SUPPORTED_MODELS:
        raise CheckpointError(f"{path}: unsupported GGUF tokenizer model {model!r}; "
                              f"supported: {list(SUPPORTED_MODELS)}")
    tokens = field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise CheckpointError(f"{path}: GGUF metadata lacks tokenizer.ggml.tokens")
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id",
            "pad": "padding_token_id"}
    ids = {k: field(reader, f"tokenizer.ggml.{v}") for k, v in keys.items()}
    for name, i in ids.items():
        if i is not None and not 0 <= int(i) < len(tokens):
            raise CheckpointError(f"{path}: GGUF {name} token id {i} is outside the "
                                  f"vocabulary of {len(tokens)}")
    # llama.cpp adds BOS to SentencePiece vocabularies that do not say otherwise.
    add_bos = field(reader, "tokenizer.ggml.add_bos_token", model == "llama")
    return GGUFVocab(model=model, pre=field(reader, "tokenizer.ggml.pre"), tokens=list(tokens),
                     types=list(field(reader, "tokenizer.ggml.token_type") or []),
                     scores=field(reader, "tokenizer.ggml.scores"),
                     merges=field(reader, "tokenizer.ggml.merges"),
                     special_ids={k: None if i is None else int(i) for k, i in ids.items()},
                     add_bos=bool(add_bos),
                     add_eos=bool(field(reader, "tokenizer.ggml.add_eos_token", False)),
                     add_space_prefix=bool(field(reader, "tokenizer.ggml.add_space_prefix", True)),
                     chat_template=field(reader, "tokenizer.chat_template"))


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (bytes that print stand for themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _gpt2_pre_tokenizer(pre: str | None) -> Any:
    if pre in SPLIT_REGEXES:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLIT_REGEXES[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre in DIGIT_THEN_GPT2:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre not in GPT2_REGEX and pre is not None:
        log.warning("GGUF pre-tokenizer %r is not known; splitting text with GPT-2's regex", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _gpt2_backend(v: GGUFVocab) -> Tokenizer:
    """Byte-level BPE. Tokens outside the byte alphabet (rare, raw special tokens) are
    respelled byte by byte, so that every vocabulary entry is reachable the same way."""
    table = _byte_alphabet()
    alphabet = set(table.values())
    vocab = {t if set(t) <= alphabet else "".join(table[b] for b in t.encode()): i
             for i, t in enumerate(v.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in v.merges or []]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, fuse_unk=False,
                               continuing_subword_prefix="", end_of_word_suffix=""))
    tok.pre_tokenizer = _gpt2_pre_tokenizer(v.pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE as merges: every split of a token into two vocabulary pieces,
    ranked by the token's score (higher first); ties: longer left, then longer right
    piece first, then token id, then the pieces' ids."""
    ids = {t: i for i, t in enumerate(tokens)}
    found = []
    for i, t in enumerate(tokens):
        if ids[t] != i:
            continue  # a duplicate spelling: the last id wins, as in llama.cpp's lookup
        pairs = sorted(((ids[t[:k]], ids[t[k:]]), t[:k], t[k:]) for k in range(1, len(t))
                       if t[:k] in ids and t[k:] in ids)
        found.extend((-scores[i], -len(left), -len(right), n, left, right)
                     for n, (_, left, right) in enumerate(pairs, start=len(found)))
    found.sort(key=lambda m: m[:4])
    return [(m[4], m[5]) for m in found]


def _llama_backend(v: GGUFVocab) -> Tokenizer:
    """SentencePiece-style BPE with byte fallback (<0xNN> tokens) and the ▁ metaspace."""
    if v.scores is None and v.merges is None:
        raise CheckpointError("GGUF SentencePiece vocabulary has neither scores nor merges")
    vocab = {t: i for i, t in enumerate(v.tokens)}  # duplicates: the last id, as llama.cpp
    merges = ([tuple(m.split(" ", 1)) for m in v.merges] if v.merges
              else spm_merges(v.tokens, list(v.scores or [])))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                               dropout=None))
    scheme = "first" if v.add_space_prefix else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPIECE_SPACE,
                                                 prepend_scheme=scheme, split=False)
    steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if v.add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _added_tokens(v: GGUFVocab, backend: Tokenizer) -> tuple[list[AddedToken], list[AddedToken]]:
    """Control tokens (special) and user-defined ones (plain), matched whole in text.
    In a byte-level vocabulary a control token spelled outside the byte alphabet is a
    mislabel from the converter, and is left out (as transformers does)."""
    alphabet = set(_byte_alphabet().values()) if v.model == "gpt2" else None
    vocab = backend.get_vocab()
    control, user = [], []
    for t, kind in zip(v.tokens, v.types):
        if kind == CONTROL and (alphabet is None or set(t) <= alphabet):
            control.append(AddedToken(t, normalized=False, special=True))
        elif kind == USER_DEFINED and t in vocab:
            user.append(AddedToken(t, normalized=False, special=False))
    return control, user


def build_tokenizer(v: GGUFVocab) -> PreTrainedTokenizerFast:
    backend = _gpt2_backend(v) if v.model == "gpt2" else _llama_backend(v)
    control, user = _added_tokens(v, backend)
    named = {f"{k}_token": v.tokens[i] for k, i in v.special_ids.items() if i is not None}
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, add_bos_token=v.add_bos,
                                  add_eos_token=v.add_eos, clean_up_tokenization_spaces=False,
                                  **named)
    if control:
        tok.add_special_tokens({"additional_special_tokens": control},
                               replace_extra_special_tokens=False)
    if user:
        tok.add_tokens(user)
    if v.chat_template:
        tok.chat_template = v.chat_template
    return tok


def load_gguf_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """The fast tokenizer described by GGUF file `path`'s metadata."""
    path = Path(path)
    return build_tokenizer(read_vocab(path))
