"""KV cache blocks, their reference counts, and the free list that doubles as the
prefix cache's LRU.

A block is in exactly one of three states:

    in use        ref_cnt > 0, not in the free queue, hash or no hash
    free+cached   ref_cnt == 0, in the free queue, block_hash set, in the hash map
    free+empty    ref_cnt == 0, in the free queue, block_hash None

Free blocks are reused from the head of the queue; a cached block that is popped for
reuse loses its hash only then (lazy eviction), so a freed prompt can still be hit
until its blocks are actually needed:

    head (evict first)                                        tail (evict last)
     [empty]<->[empty]<->[cached, freed long ago]<->...<->[cached, freed just now]

Freed blocks without a hash go to the head (they hold nothing reusable); freed cached
blocks go to the tail, so among cached blocks eviction is least-recently-freed first.

The hash map is a bijection between cached blocks and their hashes: at most one block
per hash, and `map[h].block_hash == h` for every entry.

With KV offloading on (kv_transfer/offload.py), `evicted` records the (block id, hash)
of every cached block popped for reuse, so the engine can copy its KV out before the
step that overwrites it.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from jaxserve.core.kv.prefix_hash import BlockHash


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # Links of the free queue; both None when the block is not free.
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinels; every operation is O(1).

        sentinel_head <-> b0 <-> b1 <-> ... <-> bn <-> sentinel_tail

    A block is in the queue iff its prev_free/next_free links are set.
    """

    __slots__ = ("_head", "_tail", "num_free_blocks")

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} already free"
        nxt = prev.next_free
        assert nxt is not None
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        """Insert at the tail (evicted last)."""
        prev = self._tail.prev_free
        assert prev is not None
        self._insert_after(prev, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Insert at the head (reused first)."""
        self._insert_after(self._head, block)

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not free"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def check(self) -> None:
        """Assert the links are consistent both ways (for tests; O(n))."""
        forward = list(self)
        backward = []
        node = self._tail.prev_free
        while node is not None and node is not self._head:
            backward.append(node)
            node = node.prev_free
        assert forward == backward[::-1], "free queue links are inconsistent"
        assert len(forward) == self.num_free_blocks, "free queue count is off"
        assert len({id(b) for b in forward}) == len(forward), "block twice in free queue"


class BlockPool:
    """All KV blocks, their ref counts, the free LRU queue and the hash -> block map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0      # cached blocks reused for other content
        # (block id, hash) of cached blocks reused since last taken; None: not recorded
        self.evicted: list[tuple[int, BlockHash]] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, counting evictable cached ones."""
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref_cnt > 0), 0..1."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop n blocks from the head of the free queue, each with ref_cnt 1.
        A popped cached block is evicted from the hash map now."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot get {n} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            assert block.ref_cnt == 0
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            assert self.cached.get(block.block_hash) is block
            del self.cached[block.block_hash]
            if self.evicted is not None:
                self.evicted.append((block.block_id, block.block_hash))
            block.block_hash = None
            self.num_evictions += 1

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each block (a prefix hit), unfreeing free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in the given order (callers pass a
        request's blocks tail first, so its tail is evicted before its head)."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock],
                          block_hashes: Sequence[BlockHash]) -> None:
        """Register full, in-use blocks under their hashes. A block already cached
        keeps its hash; a hash already held by another block is left with that block
        (the duplicate stays uncached), so the map stays a bijection."""
        assert len(blocks) == len(block_hashes)
        if not self.enable_caching:
            return
        for block, block_hash in zip(blocks, block_hashes):
            assert block.ref_cnt > 0, f"caching a free block {block}"
            if block.block_hash is not None:
                assert block.block_hash == block_hash, f"{block} re-hashed differently"
                continue
            if block_hash in self.cached:
                continue
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use,
        since running requests' blocks would otherwise be re-cached inconsistently."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return True

    def check(self) -> None:
        """Assert every invariant in the module docstring (for tests; O(n))."""
        self.free_queue.check()
        in_queue = {b.block_id for b in self.free_queue}
        for block in self.blocks:
            assert block.ref_cnt >= 0
            assert (block.ref_cnt == 0) == (block.block_id in in_queue), block
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, block
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash
