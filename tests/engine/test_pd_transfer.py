"""KV transfer pieces on their own: the config, the jitted block
gather/scatter against numpy indexing, the TCP stream on loopback (auth, checksum,
release on completion / failure / timeout, bounded buffer), and the scheduler's
remote-load path against a fake connector with free-block counts.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ConfigError, EngineArgs
from jaxserve.core.kv.manager import KVCacheManager
from jaxserve.kv_transfer.blocks import BlockMover
from jaxserve.kv_transfer.config import parse_kv_transfer_config
from jaxserve.kv_transfer.transport import (NONCE_BYTES, VERSION, SavedStore, TransferError,
                                            TransferServer, fetch, token_digest)
from jaxserve.core.multihost.control import recv_frame, send_frame
from jaxserve.request import FinishReason, Request
from jaxserve.sampling.params import SamplingParams
from jaxserve.core.sched.scheduler import Scheduler

# these tests count compiles after warm-up: their engines warm up at start
pytestmark = pytest.mark.warmup

# ---- config -----------------------------------------------------------------------------


def test_config_parses_and_refuses_clearly():
    cfg = parse_kv_transfer_config('{"kv_role": "kv_both", "kv_port": 0, "ttl": 5}')
    assert cfg.is_producer and cfg.is_consumer and cfg.ttl == 5
    assert not parse_kv_transfer_config({"kv_role": "kv_consumer"}).is_producer
    for bad, words in [("nope", "not valid JSON"), ('{"kv_role": "x"}', "kv_role"),
                       ('{"kv_role": "kv_producer", "port": 1}', "unknown key"),
                       ('{"kv_role": "kv_producer", "kv_port": 70000}', "kv_port"),
                       ('{"kv_role": "kv_producer", "timeout": -1}', "timeout")]:
        with pytest.raises(ValueError, match=words):
            parse_kv_transfer_config(bad)
    with pytest.raises(ConfigError, match="kv_role"):
        EngineArgs(kv_transfer_config='{"kv_role": 1}')
    with pytest.raises(ConfigError, match="needs data_parallel_backend processes"):
        EngineArgs(kv_transfer_config='{"kv_role": "kv_producer"}', data_parallel_size=2)
    with pytest.raises(ConfigError, match="multi-host"):
        EngineArgs(kv_transfer_config='{"kv_role": "kv_producer"}', num_hosts=2)
    # the processes backend is `jaxserve serve`'s: an engine built in this process (the
    # offline LLM, bench) would run in-process replicas and is refused before any work
    from jaxserve.core.data_parallel import make_engine
    args = EngineArgs(kv_transfer_config='{"kv_role": "kv_producer"}', data_parallel_size=2,
                      data_parallel_backend="processes")
    with pytest.raises(ConfigError, match="data-parallel-backend processes"):
        make_engine(args, None, None)


# ---- block gather / scatter -------------------------------------------------------------

def _cache(seed: int, layers: int = 2, heads: int = 2, blocks: int = 12, bs: int = 4,
           hd: int = 8) -> list:
    rng = np.random.default_rng(seed)
    return [tuple(jnp.asarray(rng.standard_normal((heads, blocks, bs, hd), np.float32))
                  for _ in range(2)) for _ in range(layers)]


def _np(kv: list) -> np.ndarray:            # [L, 2, K, NB, S, H]
    return np.stack([np.stack([np.asarray(k), np.asarray(v)]) for k, v in kv])


def test_gather_scatter_match_numpy_and_never_recompile(caplog):
    src, dst = _cache(0), _cache(1)
    mover = BlockMover(src, chunk_blocks=2)
    dst = mover.warmup(dst)
    # After warm-up nothing compiles again, not even for the cache becoming a committed
    # step output (which XLA once compiled anew without retracing: log, not counter)
    jax.config.update("jax_log_compiles", True)
    caplog.set_level(logging.WARNING)
    try:
        _roundtrips(src, dst, mover)
    finally:
        jax.config.update("jax_log_compiles", False)
    assert not [r for r in caplog.records if "Compiling jit(traced)" in r.getMessage()]


def _roundtrips(src: list, dst: list, mover: BlockMover) -> None:
    before = _np(dst)
    np.testing.assert_array_equal(before, _np(_cache(1)))   # warm-up wrote nothing
    compiles = mover.num_compiles
    for ids, into in [([3, 5, 7], [1, 9, 4]), ([11], [0]), ([2, 6, 8, 10], [5, 6, 7, 8])]:
        host = mover.to_host(mover.gather(src, ids), len(ids))
        np.testing.assert_array_equal(host, _np(src)[:, :, :, ids])
        dst = mover.scatter(dst, into, host)
        want = before.copy()
        want[:, :, :, into] = _np(src)[:, :, :, ids]
        np.testing.assert_array_equal(_np(dst), want)       # padding wrote nothing
        before = want
    assert mover.num_compiles == compiles == 2


# ---- the TCP stream ---------------------------------------------------------------------

GEOM = [2, 2, 4, 8, "<f4"]
SECRET = b"s3cret"


def _server(store: SavedStore, secret: bytes = SECRET, timeout: float = 5.0) -> TransferServer:
    return TransferServer(store, lambda s: s.chunks[0][:, :, :, :s.num_blocks], GEOM,
                          host="127.0.0.1", port=0, secret=secret, timeout=timeout)


def _saved(store: SavedStore, tid: str, n: int = 3) -> tuple[np.ndarray, bytes]:
    data = np.random.default_rng(n).standard_normal((2, 2, 2, n, 4, 8)).astype(np.float32)
    digest = token_digest(list(range(10)))
    assert store.put(tid, [data], n, digest, data.nbytes)
    return data, digest


def _pull(port: int, tid: str, first: int, num: int, digest: bytes,
          secret: bytes = SECRET) -> np.ndarray | None:
    return fetch("127.0.0.1", port, transfer_id=tid, first_block=first, num_blocks=num,
                 digest=digest, geometry=GEOM, shape=(2, 2, 2, num, 4, 8),
                 dtype=np.dtype(np.float32), secret=secret, timeout=5)


def test_fetch_authenticates_checks_and_releases():
    store = SavedStore(1 << 20, ttl=60)
    srv = _server(store)
    try:
        data, digest = _saved(store, "a")
        with pytest.raises(TransferError, match="authentication"):
            _pull(srv.port, "a", 0, 3, digest, secret=b"wrong")
        assert store.has("a")                               # an impostor takes nothing
        got = _pull(srv.port, "a", 1, 2, digest)
        np.testing.assert_array_equal(got, data[:, :, :, 1:3])
        assert len(store) == 0 and store.nbytes == 0        # completed: released
        with pytest.raises(TransferError, match="unknown or expired"):
            _pull(srv.port, "a", 0, 1, digest)
        _saved(store, "b")
        with pytest.raises(TransferError, match="prompt differs"):
            _pull(srv.port, "b", 0, 3, token_digest([1, 2]))
        assert len(store) == 0                              # failed: released too
        _saved(store, "c")
        with pytest.raises(TransferError, match="outside"):
            _pull(srv.port, "c", 2, 5, digest)
        _saved(store, "d")
        assert _pull(srv.port, "d", 0, 0, digest) is None   # release only
        assert len(store) == 0 and store.nbytes == 0
    finally:
        srv.close()


def test_store_is_bounded_and_expires():
    store = SavedStore(2 * 4096, ttl=0.3)
    one = np.zeros(1024, np.float32)                        # 4096 bytes
    assert store.put("a", [one], 1, b"", 4096) and store.put("b", [one], 1, b"", 4096)
    assert not store.put("c", [one], 1, b"", 4096)          # over the byte bound
    srv = _server(store)                                    # its loop sweeps expiries
    try:
        deadline = time.monotonic() + 5
        while len(store) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(store) == 0 and store.nbytes == 0 and store.expired == 2
    finally:
        srv.close()


def test_consumer_gone_mid_transfer_releases_and_server_carries_on():
    store = SavedStore(1 << 20, ttl=60)
    srv = _server(store)
    try:
        _, digest = _saved(store, "a", n=3)
        import os
        from jaxserve.core.multihost.control import handshake_mac
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            _, hello = recv_frame(s, 4096)
            mine = os.urandom(NONCE_BYTES)
            send_frame(s, "kv-fetch", {
                "v": VERSION, "nonce": mine,
                "mac": handshake_mac(SECRET, b"kv-client", hello["nonce"], mine, 0),
                "transfer_id": "a", "first_block": 0, "num_blocks": 3, "digest": digest,
                "geometry": GEOM})
            kind, head = recv_frame(s, 4096)
            assert kind == "kv-data"
            s.recv(100)                                     # a little data, then gone
        assert len(store) == 0 and store.nbytes == 0
        data, digest = _saved(store, "b")
        np.testing.assert_array_equal(_pull(srv.port, "b", 0, 3, digest), data)
    finally:
        srv.close()


def test_corrupt_or_cut_stream_is_an_error():
    """A fake producer: one sends a bad checksum, one closes half-way."""
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]
    payload = np.zeros((2, 2, 2, 1, 4, 8), np.float32).tobytes()

    def serve(mode: str) -> None:
        conn, _ = lsock.accept()
        with conn:
            send_frame(conn, "kv-challenge", {"v": VERSION, "nonce": b"n" * NONCE_BYTES})
            recv_frame(conn, 4096)
            crc = zlib.crc32(payload) ^ (1 if mode == "crc" else 0)
            send_frame(conn, "kv-data", {"v": VERSION, "mac": b"", "digest": b"",
                                          "shape": [2, 2, 2, 1, 4, 8],
                                          "dtype": "<f4", "nbytes": len(payload),
                                          "crc32": crc})
            conn.sendall(payload if mode == "crc" else payload[:100])
    try:
        for mode, words in [("crc", "checksum"), ("cut", "EOF")]:
            t = threading.Thread(target=serve, args=(mode,), daemon=True)
            t.start()
            with pytest.raises(TransferError, match=words):
                _pull(port, "x", 0, 1, b"", secret=b"")
            t.join(5)
    finally:
        lsock.close()


# ---- scheduler: the remote-load path ----------------------------------------------------

class FakeConnector:
    def __init__(self) -> None:
        self.started: dict[str, tuple[list[int], int]] = {}
        self.finished: list[str] = []

    def num_external_tokens(self, request: Request, num_local: int) -> int:
        if request.sampling_params.extra_args is None or request.request_id in self.started:
            return 0                    # one chance each, as the real connector does
        return request.num_prompt_tokens - 1 - num_local

    def start_load(self, request: Request, block_ids: list[int], num_local: int) -> None:
        self.started[request.request_id] = (block_ids, num_local)

    def release_remote(self, request: Request) -> None:
        pass

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        self.finished.append(request.request_id)

    def forget(self, req_id: str) -> None:
        pass


def _sched(num_blocks: int = 16) -> tuple[Scheduler, KVCacheManager, FakeConnector]:
    kv = KVCacheManager(num_blocks, 4)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                  block_size=4, connector=FakeConnector())
    return s, kv, s.connector


def _req(rid: str, prompt: list[int], remote: bool, max_tokens: int = 2) -> Request:
    extra = {"kv_transfer_params": {"do_remote_prefill": True}} if remote else None
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                               extra_args=extra))


def test_remote_load_waits_off_queue_then_resumes_with_its_blocks():
    s, kv, conn = _sched()
    s.add_request(_req("r", list(range(3, 14)), remote=True))     # 11 tokens: 10 loaded
    s.add_request(_req("l", list(range(20, 25)), remote=False))
    out = s.schedule()
    assert "r" in s.loading and "r" not in out.num_scheduled_tokens
    assert out.num_scheduled_tokens == {"l": 5}                   # not blocked behind it
    ids, local = conn.started["r"]
    assert local == 0 and len(ids) == 3 and kv.get_block_ids("r") == ids
    assert not any(kv.pool.blocks[i].block_hash for i in ids)     # not hittable yet
    s.update_from_output(out, {"l": [7]})
    s.finish_loading("r", 10)
    out = s.schedule()
    new = {n.req_id: n for n in out.scheduled_new_reqs}["r"]
    assert new.num_computed_tokens == 10 and new.block_ids == ids
    assert out.num_scheduled_tokens["r"] == 1                     # only the last token
    kv.check()


def test_failed_load_recomputes_and_abort_while_loading_frees():
    s, kv, _ = _sched()
    s.add_request(_req("r", list(range(3, 14)), remote=True))
    s.add_request(_req("a", list(range(30, 40)), remote=True))
    s.schedule()
    assert set(s.loading) == {"r", "a"} and kv.num_free_blocks == 16 - 6
    s.finish_requests("a", FinishReason.ABORT)
    assert "a" not in s.loading and kv.num_free_blocks == 16 - 3
    s.finish_loading("a", 9)                                      # late: ignored
    s.finish_loading("r", None)                                   # failed: recompute
    assert kv.num_free_blocks == 16
    out = s.schedule()
    assert out.num_scheduled_tokens == {"r": 11} and not s.loading
    s.finish_requests("r", FinishReason.ABORT)
    assert kv.num_free_blocks == 16
    kv.check()
