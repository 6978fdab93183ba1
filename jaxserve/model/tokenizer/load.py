"""Load a fast (Rust) tokenizer from a local checkpoint: HF files or GGUF metadata.

Never touches the network, never imports torch. The chat template comes with the
tokenizer (tokenizer_config.json / chat_template.jinja, or GGUF `tokenizer.chat_template`).
GGUF tokenizers are built from the metadata by jaxserve.model.tokenizer.gguf, because
transformers' own GGUF path needs torch, which the runtime install does not carry.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from jaxserve.deps import MissingDependencyError
from jaxserve.model.loader.errors import CheckpointError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(path: str | Path, gguf_file: str | None = None) -> PreTrainedTokenizerBase:
    """Tokenizer from directory `path` (or from `path/gguf_file`'s metadata)."""
    path = Path(path)
    where = path / gguf_file if gguf_file else path
    try:
        if gguf_file:
            # imported here: gguf_tokenizer reads files through the loader package,
            # which imports this module
            from jaxserve.model.tokenizer.gguf import load_gguf_tokenizer
            tok = load_gguf_tokenizer(where)
        else:
            # imported here: transformers' auto classes import torch where it is
            # installed (the test extra), a second or more of every process start
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{where}: cannot load a tokenizer "
                              f"({type(e).__name__}: {_first_line(e)})") from e
    if not tok.is_fast:
        raise CheckpointError(f"{path}: only fast (tokenizers) tokenizers are supported, "
                              f"got {type(tok).__name__}")
    if tok.chat_template:
        require_chat_templates()
    return tok


def require_chat_templates() -> None:
    """Chat templates are rendered by jinja2: say so at load time, not on every request."""
    try:
        import jinja2  # noqa: F401
    except ImportError as e:
        raise MissingDependencyError(
            "chat templates need the package 'jinja2', which is not installed: "
            "pip install 'jinja2>=3.1' (a runtime dependency: pip install jaxserve)") from e


def _first_line(e: Exception) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else ""
