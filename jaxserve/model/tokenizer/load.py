"""Load a fast (Rust) tokenizer from a local checkpoint: HF files or GGUF metadata.

Never touches the network, never imports torch. The chat template comes with the
tokenizer (tokenizer_config.json / chat_template.jinja, or GGUF `tokenizer.chat_template`).
GGUF tokenizers are built from the metadata by jaxserve.model.tokenizer.gguf, because
transformers' own GGUF path needs torch, which the runtime install does not carry.
"""
from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from jaxserve.deps import MissingDependencyError
from jaxserve.model.loader.errors import CheckpointError
from jaxserve.threads import beside

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
            tok = _from_pretrained(path)
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


# tokenizer_config.json classes that are the generic fast tokenizer (transformers 5 names
# it TokenizersBackend): no model-specific subclass to look up
GENERIC_FAST = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _from_pretrained(path: Path) -> Any:
    """The checkpoint's tokenizer: the generic fast class directly when its config names
    it (as the default model's cache does), else through AutoTokenizer. Imported here,
    not at the top: transformers' auto classes import torch where it is installed (the
    test extra) and build an import table of every model, about 0.4 s of every start
    that the generic class does not need."""
    try:
        cls = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        cls = None
    if cls in GENERIC_FAST:
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


class BackgroundTokenizer:
    """A tokenizer that loads on a thread of its own once started (start(), or the
    first result()): `load` is any function returning it. The engine starts it when
    its warm-up starts (EngineCore), so that `jaxserve serve`'s pure-Python start-up
    work runs beside compiling rather than before it."""

    def __init__(self, load: Callable[[], Any]) -> None:
        self._load = load
        self._future: Future | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._future is None:
                self._future = beside(self._load, name="tokenizer")

    def result(self) -> Any:
        """The tokenizer (waits for it); the load's error, if it failed, is raised here."""
        self.start()
        assert self._future is not None
        return self._future.result()


def start_loading(tokenizer: Any) -> None:
    """Start a BackgroundTokenizer's load; anything else is left as it is."""
    if isinstance(tokenizer, BackgroundTokenizer):
        tokenizer.start()


def resolved(tokenizer: Any) -> Any:
    """The tokenizer itself: a BackgroundTokenizer's, waiting for its load."""
    return tokenizer.result() if isinstance(tokenizer, BackgroundTokenizer) else tokenizer


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
