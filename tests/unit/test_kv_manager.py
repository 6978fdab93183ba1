"""KVCacheManager: block tables, allocation failure, freeing, random lifecycles."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.core.kv.manager import KVCacheManager
from jaxserve.request import Request
from jaxserve.sampling.params import SamplingParams


def _req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=100), cache_salt=salt)


def test_allocate_grows_table_by_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4, hash_seed=0)
    r = _req("a", range(10))
    assert kv.allocate_slots(r, 6) == [0, 1]            # 6 tokens -> 2 blocks
    r.num_computed_tokens = 6
    assert kv.allocate_slots(r, 2) == []                # 8 tokens still fit in 2
    r.num_computed_tokens = 8
    assert kv.allocate_slots(r, 2) == [2]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 7
    assert abs(kv.usage - 0.3) < 1e-9
    kv.check()


def test_allocate_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4, hash_seed=0)
    a, b = _req("a", range(8)), _req("b", range(100, 108))
    assert kv.allocate_slots(a, 8) == [0, 1]
    assert kv.allocate_slots(b, 8) is None
    assert kv.get_block_ids("b") == [] and kv.num_free_blocks == 1
    kv.check()


def test_free_releases_tail_first():
    """After freeing, the request's tail block is reused before its head block."""
    kv = KVCacheManager(num_blocks=3, block_size=2, hash_seed=0)
    a = _req("a", [1, 2, 3, 4, 5, 6, 7])
    kv.allocate_slots(a, 6)                 # three full blocks, all cached
    kv.free(a)
    assert [b.block_id for b in kv.pool.free_queue] == [2, 1, 0]
    b = _req("b", [9, 9])
    assert kv.allocate_slots(b, 2) == [2]   # evicts a's last block, keeps its prefix
    hits, n = kv.get_computed_blocks(_req("c", [1, 2, 3, 4, 5]))
    assert [x.block_id for x in hits] == [0, 1] and n == 4
    kv.free(b)
    kv.check()


def test_free_unknown_request_is_noop():
    kv = KVCacheManager(num_blocks=2, block_size=2)
    kv.free(_req("nobody", [1]))
    assert kv.num_free_blocks == 2


def test_hits_are_not_evicted_by_own_allocation():
    """A free cached hit must be taken before fresh blocks are popped."""
    kv = KVCacheManager(num_blocks=2, block_size=2, hash_seed=0)
    a = _req("a", [1, 2, 3])
    kv.allocate_slots(a, 3)
    kv.free(a)                              # block 0 cached+free, block 1 empty
    b = _req("b", [1, 2, 7, 8])
    hits, n = kv.get_computed_blocks(b)
    assert n == 2
    assert kv.allocate_slots(b, 2, hits) == [0, 1]
    assert kv.allocate_slots(_req("c", [5]), 1) is None
    kv.check()


def test_evictable_hits_do_not_count_twice():
    kv = KVCacheManager(num_blocks=2, block_size=2, hash_seed=0)
    a = _req("a", [1, 2, 3, 4])
    kv.allocate_slots(a, 4)
    kv.free(a)                              # both blocks cached and free
    b = _req("b", [1, 2, 3, 4, 5, 6, 7])
    hits, n = kv.get_computed_blocks(b)
    assert n == 4
    # 7 tokens need 4 blocks: 2 hits + 2 fresh, but only the hits are free
    assert kv.allocate_slots(b, 3, hits) is None
    assert kv.num_free_blocks == 2
    kv.check()


# ------------------------------------------------------------- random lifecycles
_op = st.tuples(st.sampled_from(["admit", "step", "step", "step", "finish", "preempt"]),
                st.integers(0, 1000), st.integers(1, 9))


@settings(max_examples=120, deadline=None)
@given(ops=st.lists(_op, max_size=50), caching=st.booleans())
def test_random_lifecycle_no_leak(ops, caching):
    """allocate / append / free / preempt in any order: ref counts always equal the
    number of live tables holding a block, and everything is free at the end."""
    bs, num_blocks = 3, 12
    kv = KVCacheManager(num_blocks, bs, enable_prefix_caching=caching, hash_seed=1)
    live: dict[str, Request] = {}
    for i, (kind, x, n) in enumerate(ops):
        if kind == "admit":
            r = _req(f"r{i}", [(x + j) % 3 for j in range(n + x % 5)])
            hits, hit_tokens = kv.get_computed_blocks(r)
            assert hit_tokens < r.num_tokens
            take = min(n, r.num_tokens - hit_tokens)
            if kv.allocate_slots(r, take, hits) is not None:
                r.num_computed_tokens = hit_tokens + take
                live[r.request_id] = r
        elif kind in ("step", "finish", "preempt") and live:
            r = list(live.values())[x % len(live)]
            if kind == "step":
                if r.num_computed_tokens == r.num_tokens:
                    r.output_token_ids.append(x % 3)       # "sampled"
                take = min(n, r.num_tokens - r.num_computed_tokens)
                if kv.allocate_slots(r, take) is not None:
                    r.num_computed_tokens += take
            else:
                kv.free(r)
                del live[r.request_id]
        kv.check()
        for r in live.values():
            assert len(kv.get_block_ids(r.request_id)) == kv.num_blocks_for(
                r.num_computed_tokens)
    for r in live.values():
        kv.free(r)
    kv.check()
    assert kv.num_free_blocks == num_blocks and kv.usage == 0.0
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
