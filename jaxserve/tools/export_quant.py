"""The quantized-weights half of the export check (tools/export_check.py --quantization).

A weight-only int8 step is worth its bandwidth only if the int8 matrices are what the
step reads from HBM: a dequantized [N, K] float copy written as a buffer and read back
by a dot costs more traffic than the float weights did. On this CPU host only the
StableHLO of the step exists (no TPU or CUDA compiler runs), so whether XLA would fuse a
`convert` into a dot cannot be seen. What can be seen: every op outside a custom call
and every value it produces. The check therefore asserts that, in a decode bucket, no
float tensor of a quantized weight's shape ([N, K] or [K, N]) is produced or consumed
by any op other than a kernel's custom call; the int8 matrices then reach the Pallas
kernel (kernels_pallas/quant_matmul) untouched, and its tiles are widened on chip.

    materialized(mlir, shapes)  the offending ops, [] when the property holds
    quantize_abstract(cfg, w)   abstract weights -> abstract int8 QArrays, the way the
                                loader quantizes (embedding and head stay float)
"""
from __future__ import annotations

import re
from typing import Any

FLOAT_TYPES = ("bf16", "f16", "f32", "f64")
_TENSOR = re.compile(r"tensor<(\d+)x(\d+)x(\w+)>")
_OP = re.compile(r"(?:=\s*)?\"?([a-z_]+\.[a-z_.]+)")


def quantize_abstract(cfg: Any, weights: Any, dtype: Any, plan: Any = None) -> Any:
    """Abstract weights (ShapeDtypeStructs) with every 2-D projection an int8 QArray of
    abstract parts (q int8 [N, K], scale f32 [N]), like params.quantize_weights(
    embed=False); under a sharding plan each part carries the sharding, and the QArray
    the split, that the plan gives a placed one."""
    import jax
    import jax.numpy as jnp
    from jaxserve.model.params import is_spec, param_specs
    from jaxserve.model.quant import QArray

    def one(spec: Any, w: Any) -> Any:
        if len(spec.shape) != 2 or spec.hf_name in ("model.embed_tokens.weight",
                                                     "lm_head.weight"):
            return w
        rows, cols = (spec.shape[::-1] if spec.hf_transpose else spec.shape)
        parts = {"q": jax.ShapeDtypeStruct((rows, cols), jnp.int8),
                 "scale": jax.ShapeDtypeStruct((rows,), jnp.float32)}
        qa = QArray("int8", parts, (rows, cols), jnp.dtype(dtype))
        if plan is None:
            return qa
        shardings = plan.quantized_shardings(qa, spec)
        qa = qa.map_parts(lambda n, p: jax.ShapeDtypeStruct(p.shape, p.dtype,
                                                             sharding=shardings[n]))
        return plan.mark_split(qa, shardings)
    return jax.tree_util.tree_map(one, param_specs(cfg), weights, is_leaf=is_spec)


def quantized_shapes(weights: Any, mesh_shape: dict[str, int] | None = None,
                     tokens: int = 0) -> set[tuple[int, int]]:
    """(N, K) of every QArray in a weights pytree; with the mesh's axis sizes also each
    split one's per-device shape (what a shard_map region sees), less those with a side
    of `tokens` (the bucket's activations [tokens, hidden] look the same: SmolLM2's k
    projection split 3 ways is [64, 576])."""
    import jax
    from jaxserve.model.quant import is_quantized
    out: set[tuple[int, int]] = set()
    for w in jax.tree_util.tree_leaves(weights, is_leaf=is_quantized):
        if not is_quantized(w):
            continue
        out.add(tuple(w.shape))
        if mesh_shape and w.split is not None:
            def size(axes: Any) -> int:
                names = axes if isinstance(axes, tuple) else (axes,) if axes else ()
                n = 1
                for a in names:
                    n *= mesh_shape[a]
                return n
            local = (w.shape[0] // size(w.split[0]), w.shape[1] // size(w.split[1]))
            if tokens not in local:
                out.add(local)
    return out


def materialized(mlir: str, shapes: set[tuple[int, int]]) -> list[str]:
    """'op tensor<...>' for each op outside a custom call that produces or reads a float
    tensor shaped like a quantized weight (either orientation), once per distinct pair.
    Custom calls are skipped whole: a kernel's operands and results are what it says,
    and its serialized body is opaque text."""
    want = shapes | {(k, n) for n, k in shapes}
    found: dict[str, None] = {}
    for line in mlir.splitlines():
        if "custom_call" in line or "tensor<" not in line:
            continue
        for m in _TENSOR.finditer(line):
            if m.group(3) in FLOAT_TYPES and (int(m.group(1)), int(m.group(2))) in want:
                op = _OP.search(line.split("=", 1)[-1] if "=" in line else line)
                found[f"{op.group(1) if op else '?'} {m.group(0)}"] = None
    return list(found)
