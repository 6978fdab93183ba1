"""jaxserve's own format: an orbax checkpoint of the weights pytree, plus HF-style
config.json (with "jaxserve_format": "orbax") and tokenizer files.

    DST/config.json   ModelConfig.to_hf_dict() + jaxserve_format, jaxserve_dtype
    DST/weights/      orbax StandardCheckpointer (one array per parameter)
    DST/tokenizer.json, tokenizer_config.json, chat_template.jinja, ...

Loading needs no renaming, dequantizing or transposing: the fast path.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxserve.model.config import ModelConfig
from jaxserve.model.loader.assemble import resolve_dtype
from jaxserve.model.loader.errors import CheckpointError
from jaxserve.model.loader.safetensors_dir import read_json
from jaxserve.model.params import abstract_params

FORMAT_KEY = "jaxserve_format"
WEIGHTS = "weights"


def is_orbax_dir(path: Path) -> bool:
    if not (path / "config.json").is_file():
        return False
    try:
        return json.loads((path / "config.json").read_text()).get(FORMAT_KEY) == "orbax"
    except (OSError, ValueError, AttributeError):
        return False


def save_orbax(dst: Path, cfg: ModelConfig, weights: dict[str, Any]) -> None:
    """Write weights and config.json into dst (the tokenizer is saved by the caller)."""
    dst.mkdir(parents=True, exist_ok=True)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save((dst / WEIGHTS).absolute(), weights, force=True)
    ckpt.wait_until_finished()
    ckpt.close()
    hf = cfg.to_hf_dict()
    hf[FORMAT_KEY] = "orbax"
    hf["jaxserve_dtype"] = jnp.dtype(weights["embed"].dtype).name
    (dst / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


def load_orbax(path: Path, dtype: str) -> tuple[ModelConfig, dict[str, Any]]:
    hf = read_json(path / "config.json")
    cfg = ModelConfig.from_hf_dict(hf)
    stored = resolve_dtype("auto", hf.get("jaxserve_dtype"))
    target = resolve_dtype(dtype, hf.get("jaxserve_dtype"))
    ckpt = ocp.StandardCheckpointer()
    try:
        weights = ckpt.restore((path / WEIGHTS).absolute(), abstract_params(cfg, stored))
    except Exception as e:  # orbax/tensorstore raise many types for damaged dirs
        raise CheckpointError(f"{path}: cannot restore orbax weights "
                              f"({type(e).__name__}: {str(e).strip()[:160]})") from e
    finally:
        ckpt.close()
    if target != stored:
        weights = jax.tree.map(lambda a: a.astype(target), weights)
    return cfg, weights
