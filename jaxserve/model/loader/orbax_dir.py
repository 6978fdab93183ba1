"""jaxserve's own format: an orbax checkpoint of the weights pytree, plus HF-style
config.json (with "jaxserve_format": "orbax") and tokenizer files.

    DST/config.json   ModelConfig.to_hf_dict() + jaxserve_format, jaxserve_dtype
    DST/weights/      orbax StandardCheckpointer (one array per parameter)
    DST/tokenizer.json, tokenizer_config.json, chat_template.jinja, ...

Loading needs no renaming, dequantizing or transposing. Every array is
restored into an explicit target sharding, never the one recorded at save time (that
names the saving machine's devices): one local device by default, or the mesh's
shardings (`shardings=`), in which case each process reads only the slices its own
devices hold - the multi-host case, where the weights never exist whole on any host.
On one host a safetensors directory loads faster (docs/loading.md).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from jaxserve.model.config import ModelConfig
from jaxserve.model.loader.assemble import resolve_dtype
from jaxserve.model.loader.errors import CheckpointError
from jaxserve.model.loader.safetensors_dir import read_json
from jaxserve.model.params import abstract_params

FORMAT_KEY = "jaxserve_format"
WEIGHTS = "weights"

# (config) -> the weights pytree's structure with a jax.sharding.Sharding per leaf
ShardingsFor = Callable[[ModelConfig], Any]


def is_orbax_dir(path: Path) -> bool:
    if not (path / "config.json").is_file():
        return False
    try:
        return json.loads((path / "config.json").read_text()).get(FORMAT_KEY) == "orbax"
    except (OSError, ValueError, AttributeError):
        return False


def _checkpointer() -> Any:
    """A checkpointer for this process alone: a restore is a per-process act (each
    process reads its own slices, from its own host's copy), so orbax must not wait at
    barriers for the other processes, which may not be restoring at all."""
    import orbax.checkpoint as ocp  # imported when used: ~0.2 s
    if jax.process_count() == 1:
        return ocp.StandardCheckpointer()
    me = jax.process_index()
    opts = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me},
                                              barrier_sync_key_prefix=f"jaxserve-p{me}")
    return ocp.StandardCheckpointer(multiprocessing_options=opts)


def save_orbax(dst: Path, cfg: ModelConfig, weights: dict[str, Any]) -> None:
    """Write weights and config.json into dst (the tokenizer is saved by the caller)."""
    import orbax.checkpoint as ocp  # imported when used: ~0.2 s
    if jax.process_count() > 1:
        # orbax would make this a collective save of every process (and refuses arrays
        # that live on one host).
        raise CheckpointError("save an orbax checkpoint from a single process (`jaxserve "
                              "convert`), not from inside a multi-host run")
    dst.mkdir(parents=True, exist_ok=True)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save((dst / WEIGHTS).absolute(), weights, force=True)
    ckpt.wait_until_finished()
    ckpt.close()
    hf = cfg.to_hf_dict()
    hf[FORMAT_KEY] = "orbax"
    hf["jaxserve_dtype"] = jnp.dtype(weights["embed"].dtype).name
    (dst / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


def restore_target(cfg: ModelConfig, dtype: Any, shardings: Any = None) -> Any:
    """The abstract weights tree orbax restores into: shape, dtype (orbax casts while
    reading) and sharding per leaf; shardings=None -> the first local device."""
    abstract = abstract_params(cfg, dtype)
    if shardings is None:
        one = SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: one, abstract)
    a_leaves, a_def = jax.tree.flatten(abstract)
    s_leaves, s_def = jax.tree.flatten(shardings)
    if a_def != s_def:
        raise ValueError(f"shardings do not match the model's parameter tree:\n{s_def}\n"
                         f"vs\n{a_def}")
    return jax.tree.unflatten(a_def, [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                                      for a, s in zip(a_leaves, s_leaves)])


def load_orbax(path: Path, dtype: str, shardings: ShardingsFor | None = None
               ) -> tuple[ModelConfig, dict[str, Any]]:
    """(config, weights) with every array in its target sharding: shardings(config)
    when given (every process of a multi-host run must call this together, with the same
    mesh), else the first local device."""
    hf = read_json(path / "config.json")
    cfg = ModelConfig.from_hf_dict(hf)
    target = restore_target(cfg, resolve_dtype(dtype, hf.get("jaxserve_dtype")),
                            None if shardings is None else shardings(cfg))
    ckpt = _checkpointer()
    try:
        weights = ckpt.restore((path / WEIGHTS).absolute(), target)
    except Exception as e:  # orbax/tensorstore raise many types for damaged dirs
        raise CheckpointError(f"{path}: cannot restore orbax weights "
                              f"({type(e).__name__}: {str(e).strip()[:160]})") from e
    finally:
        ckpt.close()
    return cfg, weights
