"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE, OLMoE): router, sorted dispatch, grouped
matmul, and expert parallelism.

    moe_mlp(x [T, D], layer, cfg) -> [T, D]

1. Route: logits = x @ router [T, E]; softmax in float32; top-k; each family's
   normalisation (`route`).
2. Dispatch: the T*k (token, expert) pairs are sorted by expert, so each expert's rows
   are one contiguous group; the group sizes are data, the shapes are fixed (T*k rows
   whatever the routing: a bucketed step never recompiles, and no token is dropped).
3. Grouped matmul over the sorted rows: `lax.ragged_dot` (one grouped GEMM per matrix;
   on TPU/GPU it lowers to XLA's ragged dot), and on CPU -- where jax lowers ragged_dot
   to a dense product with every expert -- a loop over fixed-size row chunks of the
   groups, each against its own expert's weights (`_grouped_mlp_chunks`). Either way
   the work is the k experts a token chose, not all E.
4. Combine: unsort, scale by the routing weights, add each token's k outputs in
   ascending expert order in the activation dtype (transformers' index_add order).

Expert parallelism (`ExpertPartition`, built by parallel/shard.py): expert weights
[E, ...] are split over the mesh axes of the `expert` logical axis (EP) and/or each
expert's hidden F over those of `moe_ffn` (TP inside experts). Every device gets all
tokens and their routing (replicated; routing is cheap and identical everywhere),
computes the pairs whose expert it holds (with its F slice), and a psum over those
axes adds the partial outputs. Each (token, expert) pair is computed on exactly one
device (or split over F and summed), every other device contributes exact zeros, so
the result is the single-device sum up to the order of float additions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxserve.model.config import ModelConfig

# Router orders (ModelConfig.moe_router):
#   "mixtral":      softmax over all E in float32, top-k, always renormalised over the k
#                   (equal to a softmax over the k top logits); weights stay float32.
#   "softmax_topk": softmax over all E in float32, top-k, renormalised only with
#                   norm_topk_prob (Qwen3-MoE, OLMoE); weights cast to the activation dtype.
ROUTERS = ("mixtral", "softmax_topk")
MAX_CHUNK_ROWS = 128     # CPU grouped matmul: rows per chunk at most (see _chunk_rows)
# One chunk's weight read (3 expert matrices) costs about as much as this many rows of
# its matmuls; 8 beat 20 and a mean-group-size rule at 128 and 512 rows
# (docs/benchmarks.md, "Measurements behind code choices").
READ_ROWS = 8


@dataclass(frozen=True)
class ExpertPartition:
    """How one MoE layer's expert weights are split over a mesh (None in the config:
    one device, or everything replicated)."""
    mesh: Any                         # jax.sharding.Mesh
    expert_axes: tuple[str, ...]      # mesh axes the E experts are split over (EP)
    ffn_axes: tuple[str, ...]         # mesh axes each expert's F is split over (TP)


def route(x: jax.Array, router: Any, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """x [T, D] -> (expert ids [T, k] int32, routing weights [T, k]) in cfg's order."""
    logits = cfg.linear(x, router)                                  # [T, E], x's dtype
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, ids = lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.moe_router == "mixtral" or cfg.norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    if cfg.moe_router != "mixtral":
        top = top.astype(x.dtype)
    return ids.astype(jnp.int32), top


def moe_mlp(x: jax.Array, layer: dict, cfg: ModelConfig) -> jax.Array:
    """The MoE block: x [T, D] -> [T, D] (layer holds router, w_gate_e, w_up_e, w_down_e)."""
    ids, weights = route(x, layer["router"], cfg)
    experts = (layer["w_gate_e"], layer["w_up_e"], layer["w_down_e"])
    part = cfg.moe_partition
    if part is None:
        return expert_outputs(x, ids, weights, *experts)
    return _sharded_experts(part, x, ids, weights, *experts)


def expert_outputs(x: jax.Array, ids: jax.Array, weights: jax.Array, w_gate: jax.Array,
                   w_up: jax.Array, w_down: jax.Array, first_expert: Any = 0) -> jax.Array:
    """Sum over each token's chosen experts of weight * SwiGLU_e(x), for the experts
    held here: w_gate/w_up [El, D, F], w_down [El, F, D] are experts first_expert ..
    first_expert + El - 1; pairs routed elsewhere contribute zero. -> [T, D]"""
    T, k = ids.shape
    El = w_gate.shape[0]
    local = ids - first_expert
    mine = (local >= 0) & (local < El)                                # [T, k]
    key = jnp.where(mine, local, El).reshape(-1)                      # [R], R = T*k
    order = jnp.argsort(key, stable=True)                             # rows by expert
    sizes = jnp.bincount(key, length=El + 1)[:El].astype(jnp.int32)   # [El], pairs elsewhere last
    ys = grouped_mlp(x[order // k], w_gate, w_up, w_down, sizes)      # [R, D]
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(T, k, -1)        # back to (token, slot)
    return combine(y, weights, ids, mine, x.dtype)


def combine(y: jax.Array, weights: jax.Array, ids: jax.Array, mine: jax.Array,
            dtype: Any) -> jax.Array:
    """y [T, k, D] expert outputs -> [T, D]: each scaled by its weight, cast to dtype,
    and added in ascending expert order (what transformers' index_add loop does; it
    matters in bfloat16)."""
    by_id = jnp.argsort(ids, axis=-1)
    y = jnp.take_along_axis(y, by_id[..., None], axis=1)
    w = jnp.take_along_axis(weights, by_id, axis=1)
    keep = jnp.take_along_axis(mine, by_id, axis=1)
    acc = jnp.zeros((y.shape[0], y.shape[2]), dtype)
    for j in range(y.shape[1]):
        c = (y[:, j] * w[:, j, None]).astype(dtype)
        acc = acc + jnp.where(keep[:, j, None], c, jnp.zeros_like(c))
    return acc


# ---- grouped matmul over rows sorted by expert ------------------------------------------

def grouped_mlp(xs: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                sizes: jax.Array) -> jax.Array:
    """xs [R, D] rows sorted by expert, sizes [G] rows per expert (sum <= R) ->
    SwiGLU of each row with its expert's weights [R, D]; rows past sum(sizes) are
    zero or garbage (callers mask them). Picks the grouped-matmul form per platform at
    lowering time (so an export for TPU/GPU gets ragged_dot even when traced on CPU)."""
    return lax.platform_dependent(xs, w_gate, w_up, w_down, sizes,
                                  cpu=_grouped_mlp_chunks, default=grouped_mlp_ragged)


def grouped_mlp_ragged(xs: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                       w_down: jax.Array, sizes: jax.Array) -> jax.Array:
    """Three lax.ragged_dot grouped GEMMs (XLA's ragged dot on TPU and GPU)."""
    h = jax.nn.silu(lax.ragged_dot(xs, w_gate, sizes)) * lax.ragged_dot(xs, w_up, sizes)
    return lax.ragged_dot(h.astype(xs.dtype), w_down, sizes)


def _chunk_rows(rows: int, groups: int) -> int:
    """Rows per chunk C (a power of two <= rows): each chunk re-reads its expert's
    weights (about rows / C reads in all) and each group's last chunk computes up to C
    padding rows (about groups * C / 2 in all); C = sqrt(2 * READ_ROWS * rows / groups)
    balances the two (READ_ROWS)."""
    best = (2 * READ_ROWS * rows / max(groups, 1)) ** 0.5
    c = 1
    while c * 2 <= min(rows, MAX_CHUNK_ROWS) and c * 2 <= best * 1.41:
        c *= 2
    return c


def _grouped_mlp_chunks(xs: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                        w_down: jax.Array, sizes: jax.Array) -> jax.Array:
    """The CPU form of grouped_mlp: a while loop over the chunks that hold rows (a
    data-dependent count); chunk j covers C rows of one group, starting inside it, and
    writes back only the rows of its group. Each expert's weights are read once per
    chunk of its rows; empty experts cost nothing."""
    R, D = xs.shape
    C = _chunk_rows(R, w_gate.shape[0])
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    chunks = (sizes + C - 1) // C                                     # per group
    chunk_end = jnp.cumsum(chunks)
    xp = jnp.concatenate([xs, jnp.zeros((C, D), xs.dtype)])          # no clamped slices
    out = jnp.zeros((R + C, D), xs.dtype)

    def body(carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        j, out = carry
        g = jnp.searchsorted(chunk_end, j, side="right")             # this chunk's expert
        s = starts[g] + (j - (chunk_end[g] - chunks[g])) * C
        xc = lax.dynamic_slice_in_dim(xp, s, C)
        h = jax.nn.silu(xc @ w_gate[g]) * (xc @ w_up[g])
        yc = (h.astype(xs.dtype) @ w_down[g]).astype(xs.dtype)
        inside = (s + jnp.arange(C)) < ends[g]
        old = lax.dynamic_slice_in_dim(out, s, C)
        out = lax.dynamic_update_slice_in_dim(out, jnp.where(inside[:, None], yc, old), s, 0)
        return j + 1, out

    _, out = lax.while_loop(lambda c: c[0] < chunk_end[-1], body, (jnp.int32(0), out))
    return out[:R]


# ---- expert parallelism ----------------------------------------------------------------

def _axes(axes: tuple[str, ...]) -> Any:
    return None if not axes else (axes[0] if len(axes) == 1 else axes)


def _sharded_experts(part: ExpertPartition, x: jax.Array, ids: jax.Array,
                     weights: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                     w_down: jax.Array) -> jax.Array:
    """expert_outputs per device under shard_map: tokens and routing replicated, each
    device its experts (and/or F slice), then a psum over the split axes."""
    ex, ff = _axes(part.expert_axes), _axes(part.ffn_axes)
    reduce = part.expert_axes + part.ffn_axes

    def local(x, ids, weights, wg, wu, wd):
        first = lax.axis_index(ex) * wg.shape[0] if ex is not None else 0
        y = expert_outputs(x, ids, weights, wg, wu, wd, first)
        return lax.psum(y, reduce)

    rep = P()
    fn = jax.shard_map(local, mesh=part.mesh,
                       in_specs=(rep, rep, rep, P(ex, None, ff), P(ex, None, ff),
                                 P(ex, ff, None)),
                       out_specs=rep, check_vma=False)
    return fn(x, ids, weights, w_gate, w_up, w_down)
