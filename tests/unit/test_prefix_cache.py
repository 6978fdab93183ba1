"""Prefix cache: block hashes, hits, salts, LRU eviction, counters, consistency."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.core.kv.manager import KVCacheManager
from jaxserve.core.kv.prefix_hash import BlockHasher
from jaxserve.request import Request
from jaxserve.sampling.params import SamplingParams


def _req(rid: str, tokens, salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=100), cache_salt=salt)


def _admit(kv: KVCacheManager, r: Request) -> int:
    """Admit the whole request in one step (as the scheduler would); return hits."""
    hits, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, hits) is not None
    r.num_computed_tokens = r.num_tokens
    return n


def test_hasher_is_keyed_and_canonical():
    h0, h0b, h1 = BlockHasher(0), BlockHasher(0), BlockHasher(1)
    assert h0.hash_block(None, [1, 2]) == h0b.hash_block(None, [1, 2])
    assert h0.hash_block(None, [1, 2]) != h1.hash_block(None, [1, 2])
    assert h0.hash_block(None, [1, 2]) != h0.hash_block(None, [2, 1])
    assert h0.hash_block(None, [1, 2]) != h0.hash_block(None, [1, 2, 0])
    assert h0.hash_block(None, [256]) != h0.hash_block(None, [0, 1])
    parent = h0.hash_block(None, [7])
    assert h0.hash_block(parent, [1, 2]) != h0.hash_block(None, [1, 2])
    assert h0.hash_block(None, [1], ("1",)) != h0.hash_block(None, [1], (1,))
    assert h0.hash_block(None, [1], ("ab", "c")) != h0.hash_block(None, [1], ("a", "bc"))
    assert len(BlockHasher().hash_block(None, [1])) == 32
    assert BlockHasher().hash_block(None, [1]) != BlockHasher().hash_block(None, [1])


def test_hit_shares_blocks_and_never_whole_prompt():
    kv = KVCacheManager(num_blocks=16, block_size=4, hash_seed=0)
    a = _req("a", range(8))                      # exactly two full blocks
    assert _admit(kv, a) == 0
    b = _req("b", range(8))
    hits, n = kv.get_computed_blocks(b)
    assert n == 4 and len(hits) == 1             # last block left to compute
    kv.allocate_slots(b, 4, hits)
    assert kv.get_block_ids("b")[0] == kv.get_block_ids("a")[0]
    assert kv.pool.blocks[kv.get_block_ids("a")[0]].ref_cnt == 2
    c = _req("c", range(9))
    assert kv.get_computed_blocks(c)[1] == 8
    d = _req("d", [0, 1, 2, 3, 99, 5, 6, 7, 8])  # diverges in block 1
    assert kv.get_computed_blocks(d)[1] == 4
    kv.check()


def test_output_tokens_are_cached_once_final():
    kv = KVCacheManager(num_blocks=16, block_size=4, hash_seed=0)
    a = _req("a", [5, 6, 7])
    _admit(kv, a)
    a.output_token_ids.append(8)                 # sampled; block 0 now full of final tokens
    assert kv.allocate_slots(a, 1) == []
    a.num_computed_tokens += 1
    a.output_token_ids.append(9)
    b = _req("b", [5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(b)[1] == 4
    kv.check()


def test_resumed_request_hits_its_own_prompt_and_outputs():
    kv = KVCacheManager(num_blocks=16, block_size=2, hash_seed=0)
    a = _req("a", [1, 2, 3])
    _admit(kv, a)
    for t in (4, 5):
        a.output_token_ids.append(t)
        kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    a.output_token_ids.append(6)                 # tokens 1..6, KV for 1..5
    kv.free(a)                                   # preempted
    a.num_computed_tokens = 0
    assert _admit(kv, a) == 4                    # [1,2][3,4] hit; [5,6] recomputed
    kv.check()


def test_different_salts_never_share():
    kv = KVCacheManager(num_blocks=32, block_size=4, hash_seed=0)
    prompt = list(range(12))
    _admit(kv, _req("a", prompt, salt="alice"))
    assert kv.get_computed_blocks(_req("b", prompt, salt="bob"))[1] == 0
    assert kv.get_computed_blocks(_req("c", prompt))[1] == 0
    assert kv.get_computed_blocks(_req("d", prompt, salt="alice"))[1] == 8
    _admit(kv, _req("e", prompt))
    assert kv.get_computed_blocks(_req("f", prompt))[1] == 8
    kv.check()


def test_lru_eviction_order():
    """Freed cached blocks are evicted least-recently-freed first."""
    kv = KVCacheManager(num_blocks=4, block_size=2, hash_seed=0)
    reqs = [_req(x, [i, i]) for i, x in enumerate("abc")]      # one full block each
    for r in reqs:
        _admit(kv, r)
    for r in reqs:                                             # free a, then b, then c
        kv.free(r)
    hog = _req("hog", [7] * 6)
    assert kv.allocate_slots(hog, 5) is not None               # needs 3 of 4 blocks
    cached = [kv.get_computed_blocks(_req("q" + r.request_id, [i, i, 9]))[1]
              for i, r in enumerate(reqs)]
    assert cached == [0, 0, 2]                                 # a and b evicted, c kept
    kv.check()


def test_stats_and_disabled_cache():
    kv = KVCacheManager(num_blocks=16, block_size=4, hash_seed=0)
    _admit(kv, _req("a", range(10)))
    _admit(kv, _req("b", range(10)))
    st_ = kv.prefix_cache_stats
    assert (st_.queries, st_.hits) == (20, 8) and st_.hit_rate == 0.4
    off = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    _admit(off, _req("a", range(10)))
    assert off.get_computed_blocks(_req("b", range(10))) == ([], 0)
    assert off.prefix_cache_stats.hit_rate == 0.0


def test_reset_prefix_cache():
    kv = KVCacheManager(num_blocks=8, block_size=2, hash_seed=0)
    a = _req("a", [1, 2, 3])
    _admit(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(_req("b", [1, 2, 3]))[1] == 0


# --------------------------------------------------------------- random sequences
_op = st.tuples(st.sampled_from(["admit", "admit", "step", "step", "finish"]),
                st.integers(0, 10**6), st.integers(1, 5))


@settings(max_examples=150, deadline=None)
@given(st.lists(_op, max_size=40))
def test_random_admit_finish_evict_consistent(ops):
    """Tiny vocab + tiny pool: many equal blocks and evictions. A hashed block in any
    table always holds exactly that table's prefix (salt included), the hash map is a
    bijection, ref counts match the tables, and nothing leaks."""
    bs = 2
    kv = KVCacheManager(num_blocks=10, block_size=bs, hash_seed=3)
    live: dict[str, Request] = {}
    content: dict[tuple[int, bytes], tuple] = {}   # (block id, hash) -> (salt, prefix)
    for i, (kind, x, n) in enumerate(ops):
        if kind == "admit":
            salt = [None, "s"][x % 2]
            r = _req(f"r{i}", [(x >> j) % 2 for j in range(1 + x % 7)], salt)
            hits, hit_tokens = kv.get_computed_blocks(r)
            assert hit_tokens < r.num_tokens and hit_tokens == len(hits) * bs
            take = min(n, r.num_tokens - hit_tokens)
            if kv.allocate_slots(r, take, hits) is not None:
                r.num_computed_tokens = hit_tokens + take
                live[r.request_id] = r
        elif live:
            r = list(live.values())[x % len(live)]
            if kind == "finish":
                kv.free(live.pop(r.request_id))
            else:
                if r.num_computed_tokens == r.num_tokens:
                    r.output_token_ids.append(x % 2)
                take = min(n, r.num_tokens - r.num_computed_tokens)
                if kv.allocate_slots(r, take) is not None:
                    r.num_computed_tokens += take
        kv.check()
        for r in live.values():
            tokens = r.all_token_ids
            for j, bid in enumerate(kv.get_block_ids(r.request_id)):
                block = kv.pool.blocks[bid]
                if block.block_hash is None:
                    continue
                assert (j + 1) * bs <= r.num_computed_tokens, "hashed before computed"
                want = (r.cache_salt, tuple(tokens[:(j + 1) * bs]))
                assert content.setdefault((bid, block.block_hash), want) == want
        cached_contents = [content[(b.block_id, h)] for h, b in kv.pool.cached.items()
                           if (b.block_id, h) in content]
        assert len(set(cached_contents)) == len(cached_contents)
    for r in live.values():
        kv.free(r)
    kv.check()
    assert kv.num_free_blocks == 10


def test_slots_beyond_known_tokens_are_not_hashed():
    """Allocating ahead of the known tokens (future draft tokens) hashes only blocks
    full of known tokens."""
    kv = KVCacheManager(num_blocks=8, block_size=2, hash_seed=0)
    r = _req("a", [1, 2, 3])
    assert kv.allocate_slots(r, 7) == [0, 1, 2, 3]
    assert [b.block_hash is not None for b in kv.pool.blocks[:4]] == [True, False, False, False]
    kv.check()
