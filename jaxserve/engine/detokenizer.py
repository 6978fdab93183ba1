"""Incremental detokenization (vLLM's prefix/read offset scheme).

Decoding token by token breaks multi-byte characters and tokenizers that merge
spaces; instead each step decodes a short window ending at the new tokens and emits
the text past what the window's prefix already produced, holding back while the
tail is an incomplete UTF-8 sequence ("\ufffd").
"""
from __future__ import annotations

from typing import Any

INITIAL_WINDOW = 5


class IncrementalDetokenizer:
    __slots__ = ("tokenizer", "ids", "prefix_offset", "read_offset", "text",
                 "skip_special_tokens")

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Seed the window with the prompt's tail so the first output token decodes in context.
        self.ids = list(prompt_ids[-INITIAL_WINDOW:])
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - INITIAL_WINDOW, 0)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly decided text."""
        out = []
        for tok in token_ids:
            self.ids.append(tok)
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                out.append(full[len(prefix):])
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
        delta = "".join(out)
        self.text += delta
        return delta
