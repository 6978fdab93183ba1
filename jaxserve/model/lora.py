"""LoRA adapters in the step: fixed-shape slot arrays and the batched delta.

Each adapted projection of a layer has, next to its base weight, a pair of slot arrays

    a [in, S, r]    b [S, r, out]       S = max_loras + 1, r = max_lora_rank

held in the layer's weights under "lora" (layer["lora"][key] = {"a": ..., "b": ...}).
Slot 0 is all zeros: the base model. An adapter of rank r' <= r fills the first r'
columns of a and rows of b of its slot (the rest stay zero, which adds nothing), with
its scale (lora_alpha / r', or / sqrt(r') with rsLoRA) folded into b. Every token of a
step carries the slot of its request (AttentionMetadata.lora_slots [T]), so one
program serves any mix of adapters, and loading one is a write into a slot: no shape
changes, no compile.

The delta of a projection y = x @ W is computed for all tokens at once, in two dense
products with the slot choice as a mask between them:

    xa  = x @ a.reshape(in, S * r)              shrink: every slot's [T, S * r]
    xa *= onehot(slot[t]) repeated r times      each token keeps its own slot's
    y  += xa @ b.reshape(S * r, out)            expand

(the layouts make both plain matmuls of contiguous arrays: with a as [S, in, r] XLA:CPU
transposed the whole slot array every step)

This costs S * r * (in + out) multiply-adds per token, next to the base's in * out (S * r
is small: tens of columns), and has no gather of per-token [in, r] matrices, which
for a prefill chunk of T tokens would move T copies of A and B through memory (4-40x
slower at 256 tokens on CPU, docs/benchmarks.md). Steps of at most GATHER_MAX_TOKENS
tokens (decode at small batch) gather instead, each token's A and B (Punica's BGMV),
which skips the S-fold shrink and measured faster there. T is static, so the choice is
made when the step is traced.

The masked form does S times the work of one adapter: with many high-rank slots (16
adapters of rank 64: 17 x 64 columns) it dominates the step. There the step groups
tokens by slot instead (SGMV's segments, with fixed shapes): tokens sorted by slot,
each slot's run padded to whole blocks of BLOCK tokens, ceil(T / BLOCK) + S blocks in
all (the most the padding can need), each block multiplied by its own slot's A and B
(gathered once per block, not per token). That costs about (T + S * BLOCK) * r *
(in + out) multiply-adds, against T * S * r * (in + out) masked; the step takes it
where that is at least BLOCKED_MIN_SAVING times less (docs/benchmarks.md: 1.6-3.6x
faster than masked at 256 tokens x 17 slots x rank 64, slower at few tokens or few
slots, where the sorting and scattering outweigh it). Every form gives a base token
(slot 0) exactly zero, so its result is the base projection's. (Gathering also beat the
masked form for 16 tokens over 17 slots of rank 64 measured alone, but made the
engine's 16-token decode steps 2x slower in the same run: not taken.)
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.model.config import ModelConfig

GATHER_MAX_TOKENS = 8      # steps up to this many tokens gather each token's A and B
BLOCK = 16                 # tokens of one block of the grouped form
BLOCKED_MIN_SAVING = 4     # grouped form where it does this many times less work
GROUPED = True             # False: never the grouped form (benchmarks compare the two)

# PEFT module name (as the Llama family, Mistral, Qwen and Gemma spell them) -> layer key
TARGETS: dict[str, str] = {
    "q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
    "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down",
}


def target_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """layer key -> (in, out) of each projection an adapter may change."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"wq": (D, q), "wk": (D, kv), "wv": (D, kv), "wo": (q, D),
            "w_gate": (D, F), "w_up": (D, F), "w_down": (F, D)}


def layer_targets(cfg: ModelConfig, layer: dict[str, Any]) -> list[str]:
    """The keys of this layer's projections that get slot arrays (a MoE layer's MLP has
    no dense gate/up/down: only its attention is adaptable)."""
    return [k for k in target_shapes(cfg) if k in layer]


def init_slots(cfg: ModelConfig, layers: list[dict[str, Any]], num_slots: int, rank: int,
               dtype: Any) -> list[dict[str, dict[str, jax.Array]]]:
    """Zeroed slot arrays for every layer: [{key: {"a": [in, S, r], "b": [S, r, out]}}]."""
    shapes = target_shapes(cfg)
    out = []
    for layer in layers:
        entry = {}
        for key in layer_targets(cfg, layer):
            i, o = shapes[key]
            entry[key] = {"a": jnp.zeros((i, num_slots, rank), dtype),
                          "b": jnp.zeros((num_slots, rank, o), dtype)}
        out.append(entry)
    return out


def delta(x: jax.Array, slots: jax.Array, ab: dict[str, jax.Array]) -> jax.Array:
    """x [T, in], slots [T] int32 -> the LoRA delta [T, out] in x's dtype (products in
    float32): gathered for small steps, grouped by slot or masked above (the module
    doc)."""
    f = form(x.shape[0], ab["b"].shape[0])
    if f == "gather":
        return delta_gather(x, slots, ab)
    if f == "blocked":
        return delta_blocked(x, slots, ab)
    return delta_masked(x, slots, ab)


def form(T: int, S: int) -> str:
    """The delta's formulation for a step of T tokens over S slots (the module doc)."""
    if T <= GATHER_MAX_TOKENS:
        return "gather"
    if GROUPED and (-(-T // BLOCK) + S) * BLOCK * BLOCKED_MIN_SAVING <= T * S:
        return "blocked"
    return "masked"


def delta_masked(x: jax.Array, slots: jax.Array, ab: dict[str, jax.Array]) -> jax.Array:
    """Every slot's shrink, the token's own kept by a one-hot mask, one expand."""
    a, b = ab["a"], ab["b"]
    fin, S, r = a.shape
    xa = jnp.matmul(x, a.reshape(fin, S * r).astype(x.dtype),
                    preferred_element_type=jnp.float32)
    keep = jnp.repeat(jax.nn.one_hot(slots, S, dtype=jnp.float32), r, axis=1)
    y = (xa * keep) @ b.reshape(S * r, b.shape[2]).astype(jnp.float32)
    return y.astype(x.dtype)


def delta_blocked(x: jax.Array, slots: jax.Array, ab: dict[str, jax.Array],
                  block: int = BLOCK) -> jax.Array:
    """Tokens grouped by slot into blocks of `block` (each slot's run padded), each block
    shrunk and expanded by its own slot's A and B; fixed shapes whatever the mix."""
    a, b = ab["a"], ab["b"]
    fin, S, r = a.shape
    T = x.shape[0]
    nb = -(-T // block) + S                 # enough for any padding of S runs
    order = jnp.argsort(slots, stable=True)
    sorted_slots = slots[order]
    counts = jnp.bincount(slots, length=S)
    padded = (counts + block - 1) // block * block
    run_start = jnp.cumsum(counts) - counts
    padded_start = jnp.cumsum(padded) - padded
    # the padded row of each sorted token
    dest = padded_start[sorted_slots] + jnp.arange(T) - run_start[sorted_slots]
    rows = nb * block
    xp = jnp.zeros((rows, fin), x.dtype).at[dest].set(x[order])
    # each block's slot (a block no token reaches stays at slot 0: zeros)
    block_slot = jnp.zeros(rows, jnp.int32).at[dest].set(sorted_slots).reshape(nb, block)[:, 0]
    xa = jnp.einsum("nti,inr->ntr", xp.reshape(nb, block, fin),
                    jnp.take(a, block_slot, axis=1).astype(x.dtype),
                    preferred_element_type=jnp.float32)
    yp = jnp.einsum("ntr,nro->nto", xa, b[block_slot].astype(jnp.float32))
    y = jnp.zeros((T, b.shape[2]), jnp.float32).at[order].set(yp.reshape(rows, -1)[dest])
    return y.astype(x.dtype)


def delta_gather(x: jax.Array, slots: jax.Array, ab: dict[str, jax.Array]) -> jax.Array:
    """Each token's A and B gathered (Punica's BGMV): [T, in, r] and [T, r, out] moved."""
    xa = jnp.einsum("ti,itr->tr", x, ab["a"][:, slots].astype(x.dtype),
                    preferred_element_type=jnp.float32)
    return jnp.einsum("tr,tro->to", xa, ab["b"][slots].astype(jnp.float32)).astype(x.dtype)


def add_delta(y: jax.Array, x: jax.Array, layer: dict[str, Any], key: str,
              slots: jax.Array | None) -> jax.Array:
    """y = x @ layer[key] (the base projection) plus the adapters' delta where the layer
    has slot arrays for it and the step carries token slots; y unchanged otherwise."""
    lora = layer.get("lora")
    if slots is None or lora is None or key not in lora:
        return y
    return y + delta(x, slots, lora[key])
