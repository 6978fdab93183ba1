"""BlockPool / FreeBlockQueue: O(1) free list, ref counts, lazy eviction."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.core.kv.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from jaxserve.core.kv.prefix_hash import BlockHash


def _h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "little"))


def test_free_queue_order_and_remove():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4]
    q.remove(blocks[2])                       # middle
    q.remove(blocks[0])                       # head
    q.remove(blocks[4])                       # tail
    assert [b.block_id for b in q] == [1, 3]
    q.append(blocks[4])
    q.appendleft(blocks[0])
    q.check()
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert q.popleft() is blocks[0]
    assert q.num_free_blocks == 3
    assert blocks[0].prev_free is None and blocks[0].next_free is None
    with pytest.raises(AssertionError):
        q.append(blocks[1])                   # already in the queue


def test_free_queue_empty_pop():
    q = FreeBlockQueue()
    with pytest.raises(IndexError):
        q.popleft()


def test_get_new_blocks_lru_and_lazy_eviction():
    pool = BlockPool(4)
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    assert pool.num_free_blocks == 1 and pool.usage == pytest.approx(0.75)
    pool.cache_full_blocks(a[:2], [_h(10), _h(11)])
    pool.free_blocks(reversed(a))             # 2 (no hash) -> head; 1 then 0 -> tail
    assert [b.block_id for b in pool.free_queue] == [2, 3, 1, 0]
    assert pool.get_cached_block(_h(10)) is a[0]   # freed but still cached
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [2, 3, 1]
    assert pool.get_cached_block(_h(11)) is None    # evicted when popped
    assert a[1].block_hash is None
    assert pool.get_cached_block(_h(10)) is a[0]
    pool.check()


def test_touch_revives_free_cached_block():
    pool = BlockPool(2)
    [b] = pool.get_new_blocks(1)
    pool.cache_full_blocks([b], [_h(1)])
    pool.free_blocks([b])
    assert pool.num_free_blocks == 2
    pool.touch([pool.get_cached_block(_h(1))])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b, b])
    pool.check()
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([b])


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [_h(5)])
    pool.cache_full_blocks([b], [_h(5)])
    assert pool.get_cached_block(_h(5)) is a and b.block_hash is None
    pool.check()


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2)
    [b] = pool.get_new_blocks(1)
    pool.cache_full_blocks([b], [_h(1)])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(_h(1)) is b
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(_h(1)) is None and b.block_hash is None
    pool.check()


def test_caching_disabled():
    pool = BlockPool(2, enable_caching=False)
    [b] = pool.get_new_blocks(1)
    pool.cache_full_blocks([b], [_h(1)])
    assert b.block_hash is None and pool.get_cached_block(_h(1)) is None


def test_too_many_blocks():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2


# op: (kind, arg) applied to a pool mirrored by a plain model of ref counts
_ops = st.lists(st.tuples(st.sampled_from(["get", "free", "touch", "cache"]),
                          st.integers(0, 7)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(_ops)
def test_pool_random_ops_match_model(ops):
    pool = BlockPool(8)
    held: list[KVCacheBlock] = []             # one entry per reference we own
    next_hash = 0
    for kind, arg in ops:
        if kind == "get" and arg <= pool.num_free_blocks:
            held += pool.get_new_blocks(arg)
        elif kind == "free" and held:
            pool.free_blocks([held.pop(arg % len(held))])
        elif kind == "touch":
            block = pool.blocks[arg]
            if block.ref_cnt > 0 or block.block_hash is not None:
                pool.touch([block])
                held.append(block)
        elif kind == "cache" and held:
            block = held[arg % len(held)]
            if block.block_hash is None:
                pool.cache_full_blocks([block], [_h(next_hash)])
                next_hash += 1
        pool.check()
        for block in pool.blocks:
            assert block.ref_cnt == sum(1 for h in held if h is block)
    pool.free_blocks(held)
    pool.check()
    assert pool.num_free_blocks == 8 and pool.usage == 0.0
