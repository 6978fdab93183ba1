"""Load a fast (Rust) tokenizer from a local checkpoint: HF files or GGUF metadata.

Never touches the network. The chat template comes with the tokenizer
(tokenizer_config.json / chat_template.jinja, or GGUF `tokenizer.chat_template`).
"""
from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from jaxserve.model.loader.errors import CheckpointError


def load_tokenizer(path: str | Path, gguf_file: str | None = None) -> PreTrainedTokenizerBase:
    """Tokenizer from directory `path` (or from `path/gguf_file`'s metadata)."""
    path = Path(path)
    try:
        tok = AutoTokenizer.from_pretrained(str(path), gguf_file=gguf_file,
                                            local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        where = path / gguf_file if gguf_file else path
        raise CheckpointError(f"{where}: cannot load a tokenizer "
                              f"({type(e).__name__}: {_first_line(e)})") from e
    if not tok.is_fast:
        raise CheckpointError(f"{path}: only fast (tokenizers) tokenizers are supported, "
                              f"got {type(tok).__name__}")
    return tok


def _first_line(e: Exception) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else ""
