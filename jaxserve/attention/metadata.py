"""AttentionMetadata: everything one step's attention needs, as a jit-friendly pytree.

Glossary: T tokens in the flat (padded) step batch, R request rows (padded),
P context blocks per row (padded), S = P * block_size context slots.

The flat batch is ragged: row r owns a contiguous run of tokens (a prefill chunk or
a single decode token). Padding tokens have `token_rows == R_pad_row` (any value
>= the number of real rows works), `slot_mapping == num_slots` (an out-of-range
slot: their K/V write is dropped) and position 0.

Block tables: the reference backend only reads context slots, so the runner makes
them just wide enough for the context (P may be 0 on pure first-chunk prefills);
kernels that read the new tokens back from the cache (Pallas) get tables wide enough
for seq_lens. Entries past a row's blocks are 0 (block 0 is a valid block; masks
keep those slots out).

KV cache layout (per layer, see worker/kv_device.py): k and v are [K, num_blocks,
block_size, H]. Block b of the pool holds slots b*block_size ... b*block_size+bs-1.
"""
from __future__ import annotations

from typing import Any

from flax import struct
import jax


@struct.dataclass
class AttentionMetadata:
    positions: jax.Array       # [T] int32 position of each token in its sequence
    slot_mapping: jax.Array    # [T] int32 flat KV slot written by each token
    token_rows: jax.Array      # [T] int32 row (request) of each token
    context_lens: jax.Array    # [R] int32 tokens already in the KV cache before this step
    seq_lens: jax.Array        # [R] int32 context_lens + this step's new tokens (0: padding)
    query_start_loc: jax.Array # [R+1] int32 row r's tokens are T[qsl[r]:qsl[r+1]]
    block_tables: jax.Array    # [R, P] int32 KV block ids of each row (see below)
    logits_indices: jax.Array  # [R] int32 index in T of each row's sampling token
    # Query tiles (reference backend, buckets with T > R; None otherwise): each row's
    # tokens cut into tiles of Qt, so a row's context is gathered once per tile instead
    # of once per token (see attention/tiles.py).
    tile_rows: jax.Array | None = None       # [C] int32 row of each tile (R: padding)
    tile_tokens: jax.Array | None = None     # [C, Qt] int32 flat token of each slot (T: empty)
    token_tile_slot: jax.Array | None = None # [T] int32 index into C*Qt of each token
    # LoRA (model/lora.py; None when the engine serves no adapters): each token's adapter
    # slot, 0 = the base model. Attention does not read it; it rides here because this
    # is the per-token metadata every layer of every step form receives.
    lora_slots: jax.Array | None = None      # [T] int32
    # The GPU attention kernel's query tiles for this step (kernel_paged.StepTiles; None
    # until the attention function's prepare_step builds them once per step, before the
    # layers: they depend only on the lengths above, so every layer shares them).
    kernel_tiles: Any = None

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]
