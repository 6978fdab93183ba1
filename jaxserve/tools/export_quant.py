"""The quantized-weights half of the export check (tools/export_check.py --quantization).

A weight-only quantized step (int8 per channel, or GGUF blocks) is worth its bandwidth
only if the quantized matrices are what the step reads from HBM: a dequantized [N, K]
float copy written as a buffer and read back by a dot costs more traffic than the float
weights did. On this CPU host only the
StableHLO of the step exists (no TPU or CUDA compiler runs), so whether XLA would fuse a
`convert` into a dot cannot be seen. What can be seen: every op outside a custom call
and every value it produces. The check therefore asserts that, in a decode bucket, no
float tensor of a quantized weight's shape ([N, K] or [K, N]) is produced or consumed
by any op other than a kernel's custom call; the quantized matrices then reach the
Pallas kernels (kernels_pallas/quant_matmul) untouched, and their tiles are widened on
chip.

    materialized(mlir, shapes)        the offending ops, [] when the property holds
    quantize_abstract(cfg, w, kind=)  abstract weights -> abstract QArrays of a kind
"""
from __future__ import annotations

import re
from typing import Any

FLOAT_TYPES = ("bf16", "f16", "f32", "f64")
_TENSOR = re.compile(r"tensor<(\d+)x(\d+)x(\w+)>")
_OP = re.compile(r"(?:=\s*)?\"?([a-z_]+\.[a-z_.]+)")


TABLES = ("model.embed_tokens.weight", "lm_head.weight")


def quantize_abstract(cfg: Any, weights: Any, dtype: Any, plan: Any = None,
                      kind: str = "int8") -> Any:
    """Abstract weights (ShapeDtypeStructs) with every 2-D projection an abstract QArray
    of `kind`: int8 (q int8 [N, K], scale f32 [N]; embedding and head stay float, as
    params.quantize_weights(embed=False) makes them) or a GGUF block format (the
    projections in it, the embedding and head in Q8_0, as llama.cpp's files usually
    keep them; Q4_K matrices whose K is not a multiple of 256 in Q8_0). Under a
    sharding plan each part carries the sharding, and the QArray the split, that the
    plan gives a placed one."""
    import jax
    import jax.numpy as jnp
    from jaxserve.model.params import is_spec, param_specs
    from jaxserve.model.quant import QArray
    from kernels_pallas.quant_matmul.blocks import part_layout

    def one(spec: Any, w: Any) -> Any:
        table = spec.hf_name in TABLES
        if len(spec.shape) != 2 or (table and kind == "int8"):
            return w
        rows, cols = (spec.shape[::-1] if spec.hf_transpose else spec.shape)
        if kind == "int8":
            parts = {"q": jax.ShapeDtypeStruct((rows, cols), jnp.int8),
                     "scale": jax.ShapeDtypeStruct((rows,), jnp.float32)}
        else:
            # Q4_K needs K in 256s; llama.cpp writes other matrices in another format
            this = "q8_0" if table or (kind == "q4_k" and cols % 256) else kind
            parts = {n: jax.ShapeDtypeStruct(shape, jnp.dtype(dt))
                     for n, shape, dt in part_layout(this, rows, cols)}
        qa = QArray(this if kind != "int8" else kind, parts, (rows, cols), jnp.dtype(dtype))
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
