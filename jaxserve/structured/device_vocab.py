"""The model's vocabulary as outlines-core sees it: token id -> the bytes it decodes to.

outlines-core walks a byte-level regex DFA over every token's bytes, so each token must
be given as the bytes it stands for, not as its tokenizer spelling:

    byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen)   "Ġthe" -> b" the"  (GPT-2's
        printable stand-ins for the 256 bytes, undone with the inverse table)
    SentencePiece-style BPE (Llama 2, Mistral)       "▁the" -> b" the", "<0x0A>" -> b"\\n"

Special and control tokens (chat markers, <|endoftext|>) are left out: a constrained
request may never emit them, except the EOS ids, which the automaton allows in final
states itself (device_automaton.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SPIECE_SPACE = "\u2581"
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character -> the byte it replaces."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table = {chr(b): b for b in kept}
    shifted = 0
    for b in range(256):
        if b not in kept:        # unprintable bytes move past 255, in byte order
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


_BYTE_LEVEL = _gpt2_byte_alphabet()


@dataclass(slots=True)
class TokenVocabulary:
    """Token bytes of a model's vocabulary, ready for outlines-core."""
    token_bytes: dict[int, bytes]          # id -> bytes (special tokens left out)
    eos_token_ids: tuple[int, ...]
    vocab_size: int                        # the model's logits width (>= tokenizer's)
    _arrays: tuple | None = field(default=None, repr=False)

    def byte_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """([V, L] uint8 each token's bytes, zero-padded; [V] int32 lengths, 0 for
        special and unused ids), L the longest token. Built once."""
        if self._arrays is None:
            L = max((len(b) for b in self.token_bytes.values()), default=1)
            data = np.zeros((self.vocab_size, L), np.uint8)
            lens = np.zeros(self.vocab_size, np.int32)
            for tid, b in self.token_bytes.items():
                data[tid, :len(b)] = np.frombuffer(b, np.uint8)
                lens[tid] = len(b)
            self._arrays = (data, lens)
        return self._arrays

    def byte_tokens(self) -> dict[int, int]:
        """byte value -> a token that is exactly that byte (where one exists)."""
        return {b[0]: tid for tid, b in sorted(self.token_bytes.items()) if len(b) == 1}

    def outlines(self) -> Any:
        """outlines_core.Vocabulary of these tokens (EOS: the first EOS id)."""
        import outlines_core
        by_bytes: dict[bytes, list[int]] = {}
        for tid, b in self.token_bytes.items():
            by_bytes.setdefault(b, []).append(tid)
        return outlines_core.Vocabulary(self.eos_token_ids[0], by_bytes)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, eos_token_ids: tuple[int, ...],
                       vocab_size: int) -> "TokenVocabulary":
        """A transformers tokenizer (fast or GGUF-built) -> its token bytes."""
        if not eos_token_ids:
            raise ValueError("structured outputs need the model's EOS token id")
        special = set(getattr(tokenizer, "all_special_ids", ()))
        for tid, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
            if getattr(tok, "special", False):
                special.add(tid)
        special.update(eos_token_ids)
        byte_level = _is_byte_level(tokenizer)
        out: dict[int, bytes] = {}
        for text, tid in tokenizer.get_vocab().items():
            if tid in special or tid >= vocab_size:
                continue
            b = _byte_level_bytes(text) if byte_level else _spiece_bytes(text)
            if b:
                out[tid] = b
        return cls(out, tuple(eos_token_ids), vocab_size)


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


def _byte_level_bytes(text: str) -> bytes:
    try:
        return bytes(_BYTE_LEVEL[c] for c in text)
    except KeyError:             # an added (non-special) token spelled in plain text
        return text.encode("utf-8")


def _spiece_bytes(text: str) -> bytes:
    m = _BYTE_TOKEN.match(text)
    if m:
        return bytes([int(m.group(1), 16)])
    return text.replace(SPIECE_SPACE, " ").encode("utf-8")
