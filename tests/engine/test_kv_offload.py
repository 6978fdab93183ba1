"""KV offload end to end on a multi-turn chat workload whose conversations evict each
other from a small device pool: greedy outputs are the same with offload off, a host
tier and host + disk tiers (float32 and int8 caches), after a restart from the disk
tier (some of its files damaged), and with a disk that fills up; the offloaded blocks
are really used (hits, fewer prompt tokens computed), the host tier stays within its
bound, and nothing compiles after warm-up."""
from __future__ import annotations

import numpy as np
import pytest

from compile_log import recording_compiles
from jaxserve import SamplingParams
from jaxserve.frontend.llm import LLM
from jaxserve.kv_transfer import offload_tiers

SEED = 3
# 16 blocks of 16 tokens; 6 conversations of 40..100 tokens cannot all stay
BASE = dict(max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64,
            token_buckets=[8, 64], num_kv_blocks=16)
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
TURNS = 3


def conversations(n: int = 6) -> tuple[list[list[int]], list[list[list[int]]]]:
    """First prompts and each later turn's new user tokens (fixed, so every engine sees
    the same prompts as long as it generates the same replies)."""
    rng = np.random.default_rng(11)
    firsts = [list(map(int, rng.integers(3, 128, 40))) for _ in range(n)]
    users = [[list(map(int, rng.integers(3, 128, 12))) for _ in range(n)]
             for _ in range(TURNS)]
    return firsts, users


def chat(llm: LLM, turns: range, history: list[list[int]] | None = None,
         check=None) -> tuple[list[list[int]], list[list[int]]]:
    """Run the given turns; each prompt is the whole history. -> (replies, history)."""
    firsts, users = conversations()
    hist = [list(p) for p in firsts] if history is None else history
    replies = []
    for t in turns:
        outs = llm.generate([{"prompt_token_ids": h} for h in hist], PARAMS, use_tqdm=False)
        for h, o, user in zip(hist, outs, users[t]):
            replies.append(list(o.outputs[0].token_ids))
            h += replies[-1] + user
        if check is not None:
            check()
    return replies, hist


@pytest.fixture()
def compiles():
    with recording_compiles() as log:
        yield log


def computed_prompt_tokens(llm: LLM) -> int:
    return llm.engine.stats.prompt_tokens


@pytest.mark.warmup
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_outputs_identical_off_host_disk(tiny_llm_factory, tmp_path, compiles,
                                         kv_cache_dtype):
    # "auto" is the default: its engine without offload is the other tests' (engine_pool)
    kw = dict(BASE, **({} if kv_cache_dtype == "auto" else dict(kv_cache_dtype=kv_cache_dtype)))
    off = tiny_llm_factory(seed=SEED, **kw)
    before = computed_prompt_tokens(off)
    want, _ = chat(off, range(TURNS))
    off_computed = computed_prompt_tokens(off) - before
    host_bound = 1 << 20
    host = tiny_llm_factory(seed=SEED, fresh=True, kv_offload_bytes=host_bound, **kw)
    # a host tier of 6 blocks: most hits must come back from disk
    row = host.engine.kv_offload.copier.bytes_per_block
    disk = tiny_llm_factory(seed=SEED, fresh=True, kv_offload_bytes=6 * row,
                            kv_offload_dir=str(tmp_path), **kw)
    for llm, bound in ((host, host_bound), (disk, 6 * row)):
        off_ = llm.engine.kv_offload
        warm = list(compiles.names)

        def within_bound():
            assert off_.host.nbytes <= bound
            off_.drain_writes()     # the next turn finds the files (not the writer's queue)

        got, _ = chat(llm, range(TURNS), check=within_bound)
        assert got == want
        assert compiles.names == warm, compiles.names[len(warm):]   # nothing after warm-up
        assert off_.copier.num_compiles == 2
        assert off_.stats.host_hits > 0 and off_.stats.bytes_to_device > 0
        assert computed_prompt_tokens(llm) < off_computed * 0.6
    assert disk.engine.kv_offload.stats.disk_hits > 0
    assert disk.engine.kv_offload.stats.bytes_from_disk > 0
    assert host.engine.kv_offload.stats.disk_queries == 0


def test_restart_answers_from_disk_and_skips_damaged_files(tiny_llm_factory, tmp_path):
    # warmed up as in the first test, whose engine without offload this is
    off = tiny_llm_factory(seed=SEED, warmup=True, **BASE)
    want, _ = chat(off, range(TURNS))
    first = tiny_llm_factory(seed=SEED, fresh=True, kv_offload_bytes=1 << 20,
                             kv_offload_dir=str(tmp_path), **BASE)
    got, hist = chat(first, range(TURNS - 1))
    first.engine.kv_offload.drain_writes()
    first.engine.shutdown()
    assert len(list(tmp_path.glob("*.kvb"))) >= 4
    # bit flips in the files of conversations 0 and 1's first blocks: the restarted
    # engine reads them first (its device cache is empty)
    hasher, damaged = first.engine.kv_manager.hasher, {}
    for c in range(2):
        f = tmp_path / (hasher.hash_block(None, hist[c][:16]).hex() + ".kvb")
        data = bytearray(f.read_bytes())
        data[-5] ^= 0xFF
        f.write_bytes(bytes(data))
        damaged[f] = bytes(data)
    again = tiny_llm_factory(seed=SEED, fresh=True, kv_offload_bytes=1 << 20,
                             kv_offload_dir=str(tmp_path), **BASE)
    before = computed_prompt_tokens(again)
    last, _ = chat(again, range(TURNS - 1, TURNS), history=hist)
    assert got + last == want
    st = again.engine.kv_offload.stats
    assert st.disk_hits > 0 and st.bytes_from_disk > 0, "the restart found nothing on disk"
    assert computed_prompt_tokens(again) - before < sum(len(h) for h in hist) // 2
    # each damaged file read was deleted (and may have been written again, whole, once
    # its block was computed anew); none is left as it was damaged
    assert again.engine.kv_offload.disk.corrupt == 2
    assert all(not f.exists() or f.read_bytes() != data for f, data in damaged.items())


def test_full_disk_turns_the_tier_off_and_serving_goes_on(tiny_llm_factory, tmp_path,
                                                          monkeypatch):
    off = tiny_llm_factory(seed=SEED, warmup=True, **BASE)
    want, _ = chat(off, range(TURNS))

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(offload_tiers, "open", full, raising=False)
    llm = tiny_llm_factory(seed=SEED, fresh=True, kv_offload_bytes=1 << 20,
                           kv_offload_dir=str(tmp_path), **BASE)
    got, _ = chat(llm, range(TURNS))
    assert got == want
    off_ = llm.engine.kv_offload
    off_.drain_writes()
    assert not off_.disk.enabled and off_.stats.host_hits > 0
    assert not list(tmp_path.glob("*.kvb"))


def test_host_hit_only_for_the_same_cache_salt(tiny_llm_factory):
    """A block offloaded under one tenant's cache_salt is never loaded for another's."""
    llm = tiny_llm_factory(seed=SEED, kv_offload_bytes=1 << 20, **BASE)
    st = llm.engine.kv_offload.stats
    firsts, _ = conversations()
    params = SamplingParams(max_tokens=2, temperature=0.0)

    def ask(salt: str) -> int:
        """Host-tier tokens the salted prompt hit."""
        before = st.host_hits
        llm.add_request({"prompt_token_ids": firsts[0]}, params, cache_salt=salt)
        llm._run([], use_tqdm=False)
        hit = st.host_hits - before
        # longer prompts (35 blocks in all) push the salted prompt's out of the device
        llm.generate([{"prompt_token_ids": p * 3} for p in firsts[1:]], params,
                     use_tqdm=False)
        return hit
    assert ask("tenant-a") == 0
    assert st.bytes_to_host > 0, "nothing was offloaded"
    assert ask("tenant-b") == 0, "another tenant's offloaded blocks were loaded"
    assert ask("tenant-a") == 32, "the same tenant did not hit its offloaded prefix"
