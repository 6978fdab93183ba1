"""KVCacheManager: the only writer of block tables and block hashes.

Per request it keeps the block table and how far that table has been offered to
the prefix cache:

    tokens  <--------- num_tokens (prompt + outputs) ---------->
    KV      <-- num_computed --><---- scheduled this step ----->
    blocks  [  b0  ][  b1  ][  b2  ][  b3  ][  b4  ][  b5  ][ b6 ..
    hashed  <-- earlier ---><-------- by this call -------->  (b6 is partial)

A block is hashed once it is full of final (known) tokens whose KV is computed by the
end of the step being scheduled. A request that hits it in that same step reads it
only after the step writes it (the attention backends write new K/V before reading),
so caching at allocation time is safe, as in vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass

from jaxserve.core.kv.block_pool import BlockPool, KVCacheBlock
from jaxserve.core.kv.prefix_hash import BlockHash, BlockHasher, extend_block_hashes
from jaxserve.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0    # tokens looked up (one lookup per get_computed_blocks call)
    hits: int = 0       # of those, tokens found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_seed: bytes | int | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.hasher = BlockHasher(hash_seed)
        self.stats = PrefixCacheStats()
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self._req_hashes: dict[str, list[BlockHash]] = {}

    # ------------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks (computed lazily, kept until free)."""
        hashes = self._req_hashes.setdefault(request.request_id, [])
        return extend_block_hashes(self.hasher, request, self.block_size, hashes)

    # --------------------------------------------------------------- allocation
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request's tokens.

        Never the whole sequence: the last token is always left to compute, so the
        step produces logits to sample from. Takes no references (allocate_slots
        does); the blocks stay valid until the next allocation."""
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in self.block_hashes(request)[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.stats.queries += request.num_tokens
        self.stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       ) -> list[int] | None:
        """Make the request's table cover num_computed + prefix hits + num_new_tokens.

        `new_computed_blocks` (from get_computed_blocks, for a request with no blocks
        yet) are referenced and put first. Returns the ids of the blocks appended to
        the table, or None (and changes nothing) if the pool cannot supply them;
        evictable cached blocks count as free, except the hits themselves."""
        hits = new_computed_blocks or []
        req_id = request.request_id
        blocks = self._req_blocks.get(req_id, [])
        if hits:
            assert not blocks and request.num_computed_tokens == 0, \
                "prefix hits are only for a request without blocks"
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        total = num_computed + num_new_tokens
        num_fresh = max(0, self.num_blocks_for(total) - len(blocks) - len(hits))
        evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_fresh > self.pool.num_free_blocks - evictable_hits:
            return None
        self.pool.touch(hits)   # before get_new_blocks, so the hits are not evicted
        new_blocks = hits + self.pool.get_new_blocks(num_fresh)
        blocks = self._req_blocks.setdefault(req_id, blocks)
        blocks.extend(new_blocks)
        if hits:
            self._num_cached_blocks[req_id] = len(hits)
        self._cache_full_blocks(request, min(total, request.num_tokens))
        return [b.block_id for b in new_blocks]

    def allocate_external(self, request: Request, hits: list[KVCacheBlock],
                          num_external_tokens: int) -> list[int] | None:
        """For a request with no blocks: reference the prefix hits and add fresh blocks
        for num_external_tokens more tokens whose KV another engine will send
        (kv_transfer/). The fresh blocks are NOT hashed: until their data has arrived no
        other request may hit them; the request's next allocate_slots hashes them.
        Returns the fresh block ids, or None (nothing changed) if the pool is short."""
        req_id = request.request_id
        assert not self._req_blocks.get(req_id) and request.num_computed_tokens == 0, \
            "external blocks are only for a request without blocks"
        total = len(hits) * self.block_size + num_external_tokens
        num_fresh = self.num_blocks_for(total) - len(hits)
        evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_fresh > self.pool.num_free_blocks - evictable_hits:
            return None
        self.pool.touch(hits)
        fresh = self.pool.get_new_blocks(num_fresh)
        self._req_blocks[req_id] = hits + fresh
        self._num_cached_blocks[req_id] = len(hits)
        return [b.block_id for b in fresh]

    def _cache_full_blocks(self, request: Request, num_final_tokens: int) -> None:
        """Hash the blocks that are full of final tokens whose KV will be computed."""
        if not self.enable_prefix_caching:
            return
        req_id = request.request_id
        start = self._num_cached_blocks.get(req_id, 0)
        end = num_final_tokens // self.block_size
        if end <= start:
            return
        hashes = self.block_hashes(request)
        self.pool.cache_full_blocks(self._req_blocks[req_id][start:end], hashes[start:end])
        self._num_cached_blocks[req_id] = end

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (its tail is evicted first)."""
        req_id = request.request_id
        blocks = self._req_blocks.pop(req_id, [])
        self.pool.free_blocks(reversed(blocks))
        self._num_cached_blocks.pop(req_id, None)
        self._req_hashes.pop(req_id, None)

    # ------------------------------------------------------------- prefix cache
    def record_evictions(self) -> None:
        """Keep the (block id, hash) of every cached block reused (for KV offloading)."""
        if self.pool.evicted is None:
            self.pool.evicted = []

    def take_evicted(self) -> list[tuple[int, BlockHash]]:
        """Cached blocks handed to other content since the last call, in order."""
        out = self.pool.evicted or []
        if self.pool.evicted is not None:
            self.pool.evicted = []
        return out

    def cached_blocks(self) -> list[tuple[int, BlockHash]]:
        """(block id, hash) of every block in the prefix cache now."""
        return [(b.block_id, h) for h, b in self.pool.cached.items()]

    def prefix_hashes(self, request: Request, first: int) -> list[BlockHash]:
        """Hashes of the request's full blocks from block `first` on, never covering its
        last token (as get_computed_blocks: that token is always computed)."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        return self.block_hashes(request)[first:max_blocks]

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.stats.queries, self.stats.hits)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash; False (nothing done) while blocks are in use."""
        return self.pool.reset_prefix_cache()

    def check(self) -> None:
        """Assert ref counts match the block tables and the pool invariants (tests)."""
        self.pool.check()
        refs = [0] * self.num_blocks
        for blocks in self._req_blocks.values():
            assert len({b.block_id for b in blocks}) == len(blocks), "block twice in a table"
            for block in blocks:
                refs[block.block_id] += 1
        assert refs == [b.ref_cnt for b in self.pool.blocks], "ref counts != tables"
