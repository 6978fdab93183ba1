"""Build the weights pytree from named HF tensors, strictly, one tensor at a time.

Every format ends here: safetensors hands over its tensors as they are, GGUF after
renaming and dequantizing them (or, kept quantized, as model.quant.QArray matrices in
HF orientation, which need no transpose). The checks (missing, unexpected, shape, dtype) are
the same for all formats, so a bad checkpoint fails the same way whatever its format.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxserve.model.config import ModelConfig
from jaxserve.model.loader.errors import CheckpointError
from jaxserve.model.params import abstract_params, iter_specs, param_specs, set_at_path
from jaxserve.model.quant import QArray

# Tensors some checkpoints carry that the decoder recomputes or does not need.
HARMLESS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
FLOAT_KINDS = ("float32", "float16", "bfloat16", "float64")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(dtype: str, checkpoint_dtype: str | None) -> Any:
    """'float32' | 'bfloat16' | 'float16' | 'auto' (the checkpoint's own, else float32)."""
    if dtype == "auto":
        dtype = checkpoint_dtype if checkpoint_dtype in DTYPES else "float32"
    if dtype not in DTYPES:
        raise CheckpointError(f"unsupported dtype {dtype!r}; use one of "
                              f"{sorted(DTYPES) + ['auto']}")
    return DTYPES[dtype]


def hf_shape(shape: tuple[int, ...], transpose: bool) -> tuple[int, ...]:
    return tuple(reversed(shape)) if transpose else tuple(shape)


def assemble_weights(cfg: ModelConfig, names: Iterable[str],
                     get_tensor: Callable[[str], np.ndarray | QArray], dtype: Any,
                     source: str, progress: bool = True) -> dict[str, Any]:
    """names: every tensor in the checkpoint; get_tensor(name) -> numpy [HF layout], or
    a QArray (numpy parts) [HF layout] for a matrix kept quantized."""
    specs = list(iter_specs(param_specs(cfg)))
    expected = {n for _, spec in specs for n in (spec.hf_stack or (spec.hf_name,))}
    present = set(names)
    missing = sorted(expected - present)
    if missing:
        raise CheckpointError(f"{source}: missing tensor {missing[0]!r}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = sorted(n for n in present - expected if not _harmless(n, cfg))
    if extra:
        raise CheckpointError(f"{source}: unexpected tensor {extra[0]!r}"
                              + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    weights = abstract_params(cfg, dtype)
    quantized = []          # (path, QArray of numpy parts): placed together at the end
    for path, spec in tqdm(specs, desc=f"loading {source.rsplit('/', 1)[-1]}", unit="tensor",
                           disable=not progress, leave=False):
        if spec.hf_stack:       # expert weights [E, ...]: one HF tensor per expert
            set_at_path(weights, path, _stacked(spec, get_tensor, dtype, source))
            continue
        a = get_tensor(spec.hf_name)
        want = hf_shape(spec.shape, spec.hf_transpose)
        if tuple(a.shape) != want:
            raise CheckpointError(f"{source}: tensor {spec.hf_name!r} has shape "
                                  f"{tuple(a.shape)}, config expects {want}")
        if isinstance(a, QArray):
            quantized.append((path, a))
            continue
        if str(a.dtype) not in FLOAT_KINDS:
            raise CheckpointError(f"{source}: tensor {spec.hf_name!r} has dtype {a.dtype}, "
                                  f"expected a float type")
        set_at_path(weights, path, jnp.asarray(a.T if spec.hf_transpose else a, dtype))
    # one device_put for every part of every quantized matrix: placed one by one, the
    # per-call overhead of a few hundred small copies was most of a load's second
    parts = jax.device_put([list(q.parts.values()) for _, q in quantized])
    for (path, q), placed in zip(quantized, parts):
        by_name = dict(zip(q.parts, placed))
        set_at_path(weights, path, q.map_parts(lambda n, _: by_name[n]))
    return weights


def _stacked(spec: Any, get_tensor: Callable[[str], Any], dtype: Any, source: str) -> Any:
    """The per-expert HF tensors of spec.hf_stack, checked, transposed, stacked."""
    want = hf_shape(spec.shape[1:], spec.hf_transpose)
    parts = []
    for name in spec.hf_stack:
        a = get_tensor(name)
        a = a.dequantize() if isinstance(a, QArray) else a
        if tuple(a.shape) != want:
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(a.shape)}, "
                                  f"config expects {want}")
        if str(a.dtype) not in FLOAT_KINDS:
            raise CheckpointError(f"{source}: tensor {name!r} has dtype {a.dtype}, "
                                  f"expected a float type")
        a = np.asarray(a)
        parts.append(a.T if spec.hf_transpose else a)
    return jnp.asarray(np.stack(parts), dtype)


def _harmless(name: str, cfg: ModelConfig) -> bool:
    # Some tied checkpoints still store the (identical) head; the decoder ignores it.
    return bool(HARMLESS.search(name)) or (cfg.tie_word_embeddings and name == "lm_head.weight")
