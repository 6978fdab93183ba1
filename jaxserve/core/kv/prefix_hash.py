"""Block hashes for the prefix cache.

A full block is identified by the chain of everything that determines its KV:

    hash(block i) = H_seed( hash(block i-1) | token ids of block i | extra keys of block i )

so equal hashes mean equal prefixes (up to a cryptographic collision). H is keyed
BLAKE2b: the key is a per-engine seed (random unless a test sets it), so hashes are not
predictable from outside and one user cannot probe another's cached prompt by hash.
Extra keys carry whatever else changes the KV of a block: the request's cache_salt
(first block only; it then flows down the chain, as in vLLM) and the LoRA adapter's
content hash (first block too: an adapter changes every layer's K/V, so no block of an
adapter's request matches the base model's or another adapter's).
Everything is serialized canonically (fixed-width little-endian ints, length-prefixed
fields); nothing is pickled.
"""
from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence
from typing import NewType

from jaxserve.request import Request

BlockHash = NewType("BlockHash", bytes)
ExtraKey = str | int | bytes

_DIGEST_SIZE = 32
_ROOT = b"\x00" * _DIGEST_SIZE    # parent of the first block


def _encode_extra(key: ExtraKey) -> bytes:
    """Type-tagged, length-prefixed bytes: ("1",) and (1,) must not collide."""
    if isinstance(key, bool):
        raise TypeError("bool extra keys are ambiguous; use int")
    if isinstance(key, int):
        tag, raw = b"i", key.to_bytes(16, "little", signed=True)
    elif isinstance(key, str):
        tag, raw = b"s", key.encode("utf-8")
    elif isinstance(key, bytes):
        tag, raw = b"b", key
    else:
        raise TypeError(f"unsupported extra key type {type(key).__name__}")
    return tag + struct.pack("<I", len(raw)) + raw


class BlockHasher:
    """Keyed hash of (parent hash, block token ids, extra keys)."""

    __slots__ = ("_key",)

    def __init__(self, seed: bytes | int | None = None) -> None:
        if seed is None:
            key = os.urandom(_DIGEST_SIZE)
        elif isinstance(seed, int):
            key = hashlib.sha256(struct.pack("<q", seed)).digest()
        else:
            key = bytes(seed)
        self._key = key[:64]    # blake2b keys are at most 64 bytes

    def hash_block(self, parent: BlockHash | None, token_ids: Sequence[int],
                   extra_keys: Sequence[ExtraKey] = ()) -> BlockHash:
        h = hashlib.blake2b(key=self._key, digest_size=_DIGEST_SIZE)
        h.update(parent if parent is not None else _ROOT)
        h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
        h.update(struct.pack("<I", len(extra_keys)))
        for key in extra_keys:
            h.update(_encode_extra(key))
        return BlockHash(h.digest())


def block_extra_keys(request: Request, block_index: int) -> tuple[ExtraKey, ...]:
    """Extra keys of one block of a request. The salt and the adapter go in the first
    block only: every later hash chains through them."""
    if block_index != 0:
        return ()
    keys: tuple[ExtraKey, ...] = ()
    if request.cache_salt is not None:
        keys = ("cache_salt", request.cache_salt)
    if request.lora is not None:
        keys += ("lora", request.lora.key)
    return keys


def extend_block_hashes(hasher: BlockHasher, request: Request, block_size: int,
                        hashes: list[BlockHash]) -> list[BlockHash]:
    """Append to `hashes` the hashes of the request's full blocks not hashed yet.

    Tokens are append-only, so hashes already computed stay valid."""
    prompt, output = request.prompt_token_ids, request.output_token_ids
    num_full = request.num_tokens // block_size
    for i in range(len(hashes), num_full):
        start, end = i * block_size, (i + 1) * block_size
        if end <= len(prompt):
            tokens = prompt[start:end]
        else:
            tokens = (prompt + output)[start:end]
        parent = hashes[i - 1] if i > 0 else None
        hashes.append(hasher.hash_block(parent, tokens, block_extra_keys(request, i)))
    return hashes
