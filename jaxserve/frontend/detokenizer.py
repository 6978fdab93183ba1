"""Incremental detokenization (vLLM's prefix/read offset scheme).

Decoding token by token breaks multi-byte characters and tokenizers that merge
spaces; instead each step decodes a short window ending at the new tokens and emits
the text past what the window's prefix already produced, holding back while the
tail is an incomplete UTF-8 sequence ("\ufffd").

Two implementations of that one scheme, chosen per request:

- `tokenizers`' Rust DecodeStream (fast path): one call per token, both decodes in
  Rust. Used when the tokenizer is a plain fast tokenizer whose `decode` is the Rust
  decoder's (no Python override) and the prompt's tail decodes cleanly.
- the Python path (fallback): two `tokenizer.decode` calls per token. Also taken
  over mid-sequence if the stream refuses a step (its prefix check), from the same
  offsets, so the output stays what the fallback alone would have produced.

Both keep `ids`, `prefix_offset` and `read_offset` in step (cheap integer updates), so
the switch needs no replay. With no tokenizer (skip_tokenizer_init) the text is empty.

The EOS or stop token that ends a sequence is not decoded (`add(..., final_stop=True)`),
as in vLLM: with skip_special_tokens off its text (`<|im_end|>`, `</s>`) would otherwise
end the output text and break what the answer is (JSON content, a tool call). It stays
in the token ids.
"""
from __future__ import annotations

from typing import Any

try:        # tokenizers >= 0.21 has DecodeStream; >= 0.22 takes the prompt's ids
    from tokenizers import Tokenizer as _RustTokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:     # pragma: no cover - an old tokenizers: fallback only
    DecodeStream = None
    _RustTokenizer = None

INITIAL_WINDOW = 5
_REPLACEMENT = "\ufffd"
_stream_ok: dict[type, bool] = {}      # tokenizer class -> its decode is the Rust one


def stream_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer a DecodeStream can step with, or None when `tokenizer.decode`
    may differ from the Rust decoder's output (a class overriding decode / _decode)."""
    if DecodeStream is None or tokenizer is None:
        return None
    cls = type(tokenizer)
    ok = _stream_ok.get(cls)
    if ok is None:
        ok = _plain_fast_decode(cls)
        _stream_ok[cls] = ok
    backend = getattr(tokenizer, "backend_tokenizer", None) if ok else None
    return backend if isinstance(backend, _RustTokenizer) else None


def _plain_fast_decode(cls: type) -> bool:
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:     # pragma: no cover
        return False
    if not issubclass(cls, PreTrainedTokenizerFast):
        return False
    # Cleanup of tokenization spaces is off in our decode calls, so the transformers
    # decode is exactly the Rust decoder's unless a subclass overrides it.
    return (cls.decode is PreTrainedTokenizerFast.decode
            and cls._decode is PreTrainedTokenizerFast._decode)


class IncrementalDetokenizer:
    __slots__ = ("tokenizer", "ids", "prefix_offset", "read_offset", "text",
                 "skip_special_tokens", "_stream", "_backend")

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True,
                 use_stream: bool = True):
        """use_stream=False forces the Python path (tests, benchmarks)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Seed the window with the prompt's tail so the first output token decodes in context.
        self.ids = list(prompt_ids[-INITIAL_WINDOW:])
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - INITIAL_WINDOW, 0)
        self.text = ""
        self._stream: Any = None
        self._backend = stream_backend(tokenizer) if use_stream else None
        # A prompt tail that ends inside a character: the stream would take an empty
        # prefix there and emit the tail's text; the Python path handles it.
        if self._backend is not None and not (
                self.ids and self._decode(self.ids).endswith(_REPLACEMENT)):
            self._stream = DecodeStream(ids=self.ids, skip_special_tokens=skip_special_tokens)

    @property
    def uses_stream(self) -> bool:
        """True while the Rust DecodeStream does the work."""
        return self._stream is not None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add(self, token_ids: list[int], final_stop: bool = False) -> str:
        """Append tokens; return the newly decided text. final_stop: the last of them is
        the EOS / stop token that ended the sequence, whose text is left out."""
        if final_stop:
            token_ids = token_ids[:-1]
        if self.tokenizer is None:
            return ""
        out = []
        stream, backend = self._stream, self._backend
        for tok in token_ids:
            self.ids.append(tok)
            if stream is not None:
                try:
                    piece = stream.step(backend, tok)
                except Exception:   # noqa: BLE001 - its prefix check: Python path from here
                    self._stream = stream = None
                    piece = self._python_step()
            else:
                piece = self._python_step()
            if piece is not None:
                out.append(piece)
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
        delta = "".join(out)
        self.text += delta
        return delta

    def _python_step(self) -> str | None:
        """The text the last appended token decides, or None (nothing yet)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            return full[len(prefix):]
        return None
