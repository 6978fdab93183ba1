"""Models named by their Hugging Face repo id (`jaxserve serve org/name`).

A model argument that is no local path but has the shape of a repo id ("org/name" or
"name", optionally "@revision") is resolved through the Hugging Face cache with
`huggingface_hub.snapshot_download`, fetching only what the loader reads (config,
generation config, tokenizer files, safetensors weights and their index, GGUF files).
Offline (HF_HUB_OFFLINE=1) the cached snapshot is used as is; HF_HUB_CACHE / HF_HOME
choose the cache. Every failure is one CheckpointError line: the CLI prints it, no
traceback.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from jaxserve.model.loader.errors import CheckpointError

ALLOW_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                  "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                  "chat_template.json", "*.safetensors", "model.safetensors.index.json",
                  "*.gguf"]
# Hugging Face's rule for repo names: letters, digits, "-", "_", "."; at most one "/".
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")


def split_revision(model: str) -> tuple[str, str | None]:
    repo, _, rev = model.partition("@")
    return repo, rev or None


def is_repo_id(model: str) -> bool:
    """True for a model argument that names a Hub repo rather than a local path: it
    does not exist here, and it has a repo id's shape (no "./", no leading "/", no
    ".gguf" file name, at most one "/")."""
    repo, _ = split_revision(model)
    if Path(model).expanduser().exists() or repo.endswith(".gguf") or ".." in repo:
        return False
    return bool(_REPO_ID.match(repo))


def resolve_repo(model: str) -> Path:
    """The local snapshot directory of a repo id (downloaded unless offline)."""
    repo, revision = split_revision(model)
    try:
        import huggingface_hub
        from huggingface_hub.errors import HfHubHTTPError
    except ImportError:                         # pragma: no cover - a transformers dep
        raise CheckpointError(f"model path not found: {model} (and huggingface_hub, "
                              f"needed to fetch it from the Hub, is not installed)") from None
    try:
        # the cache named now (huggingface_hub reads HF_HUB_CACHE once, at import)
        path = huggingface_hub.snapshot_download(repo, revision=revision,
                                                 cache_dir=os.environ.get("HF_HUB_CACHE"),
                                                 allow_patterns=ALLOW_PATTERNS)
    except (HfHubHTTPError, OSError, ValueError) as e:
        if huggingface_hub.constants.HF_HUB_OFFLINE:
            cache = os.environ.get("HF_HUB_CACHE") or huggingface_hub.constants.HF_HUB_CACHE
            why = (f"not in the Hugging Face cache ({cache})"
                   f" and HF_HUB_OFFLINE is set; download it once online or give a "
                   f"local path")
        else:
            why = f"cannot fetch it from the Hugging Face Hub: {_one_line(e)}"
        raise CheckpointError(f"model {model!r} is no local path and {why}") from None
    return Path(path)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
