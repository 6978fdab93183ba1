"""The KV-transfer path against hostile clients and peers.

A client's kv_transfer_params never make a decode server connect anywhere (directly or
through the pd router): the endpoint they name sees no connection and a plain request
for the same prompt afterwards gets the model's own greedy answer. Pulls hold at most
their share of the pool and give up at one deadline however slowly a producer trickles;
the transfer secret is required and is never the API key; idle connections to the
transfer port do not keep a decode server out.
"""
from __future__ import annotations

import hashlib
import hmac
import inspect
import json
import socket
import subprocess
import sys
import threading
import time
import zlib
from typing import Any

import httpx
import jax.numpy as jnp
import numpy as np
import pytest


from pd_harness import ROOT, PDCluster, settled  # noqa: E402
from server_harness import tiny_args, tiny_parts  # noqa: E402

from jaxserve.core.kv.manager import KVCacheManager  # noqa: E402
from jaxserve.kv_transfer import connector as connector_mod  # noqa: E402
from jaxserve.kv_transfer import transport  # noqa: E402
from jaxserve.kv_transfer.config import parse_kv_transfer_config  # noqa: E402
from jaxserve.kv_transfer.connector import KVConnector, read_secret  # noqa: E402
from jaxserve.kv_transfer.transport import SavedStore, TransferServer, fetch, token_digest  # noqa: E402,E501
from jaxserve.core.multihost.control import recv_frame, send_frame  # noqa: E402
from jaxserve.request import Request  # noqa: E402
from jaxserve.tools import stress_kv  # noqa: E402
from jaxserve.sampling.params import SamplingParams  # noqa: E402
from jaxserve.core.sched.scheduler import Scheduler  # noqa: E402

SECRET_ENV = "JAXSERVE_KV_TRANSFER_SECRET"
PRODUCER = json.dumps({"kv_role": "kv_producer", "chunk_blocks": 2, "ttl": 5})
CONSUMER = json.dumps({"kv_role": "kv_consumer", "chunk_blocks": 2, "timeout": 10})
GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)


class Impostor(stress_kv.Impostor):
    """A "prefill server" a client names: it counts connections and, to anyone that
    connects, serves random KV for whatever blocks are asked (unauthenticated)."""

    def serve(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        send_frame(conn, "kv-challenge", {"v": transport.VERSION, "nonce": b"n" * 32})
        _, req = recv_frame(conn, 4096)
        layers, heads, bs, hd, dt = req["geometry"]
        shape = [layers, 2, heads, req["num_blocks"], bs, hd]
        junk = (np.random.default_rng(0).standard_normal(shape) * 50).astype(dt).tobytes()
        send_frame(conn, "kv-data", {"v": transport.VERSION, "mac": b"",
                                      "digest": req["digest"], "shape": shape, "dtype": dt,
                                      "wire": "native", "nbytes": len(junk),
                                      "crc32": zlib.crc32(junk)})
        conn.sendall(junk)


@pytest.fixture(scope="module")
def cluster():
    c = PDCluster.start(tiny_parts(), tiny_args, PRODUCER, CONSUMER, warmup=False)
    yield c
    c.close()


def _text(url: str, body: dict) -> str:
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _prompt(seed: int, n: int = 40) -> str:
    return " ".join(f"w{(seed * 31 + 7 * i) % 120 + 3}" for i in range(n))


@pytest.mark.parametrize("via", ["decode", "router"])
def test_client_named_prefill_server_is_never_contacted(cluster, via):
    colo, pre, dec, router = cluster
    impostor = Impostor()
    prompt = _prompt(1 if via == "decode" else 2)
    try:
        want = _text(colo.url, {"prompt": prompt, **GREEDY})
        forged = {"do_remote_prefill": True, "remote_host": "127.0.0.1",
                  "remote_port": impostor.port, "remote_engine_id": "x",
                  "transfer_id": "t-" + via, "signature": "0" * 64}
        url = dec.url if via == "decode" else router.url
        assert _text(url, {"prompt": prompt, **GREEDY, "kv_transfer_params": forged}) == want
        # the same prompt again, plainly: its prefix-cache hits hold the model's own KV
        assert _text(dec.url, {"prompt": prompt, **GREEDY}) == want
        assert impostor.connections == 0
        settled(pre, dec)
    finally:
        impostor.close()


def test_silent_listener_named_by_client_holds_no_blocks(cluster):
    colo, pre, dec, _ = cluster
    silent = socket.create_server(("127.0.0.1", 0), backlog=16)    # never accepts
    try:
        prompt = _prompt(3)
        want = _text(colo.url, {"prompt": prompt, **GREEDY})
        params = {"do_remote_prefill": True, "remote_host": "127.0.0.1",
                  "remote_port": silent.getsockname()[1], "transfer_id": "silent"}
        t0 = time.monotonic()
        assert _text(dec.url, {"prompt": prompt, **GREEDY, "kv_transfer_params": params}) \
            == want
        assert time.monotonic() - t0 < 8           # no wait on the consumer's 10 s timeout
        silent.settimeout(0.3)
        with pytest.raises(socket.timeout):
            silent.accept()                         # nobody connected
        assert not dec.engine.core.scheduler.loading
        settled(pre, dec)
    finally:
        silent.close()


# ---- unit level: the connector's checks, the pending-pull cap, the pull deadline --------

GEOM_CACHE = dict(layers=2, heads=2, blocks=12, bs=4, hd=8)


def _kv_cache() -> list:
    shape = (GEOM_CACHE["heads"], GEOM_CACHE["blocks"], GEOM_CACHE["bs"], GEOM_CACHE["hd"])
    return [(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
            for _ in range(GEOM_CACHE["layers"])]


def _signed(secret: bytes, port: int, prompt: list[int], **over: Any) -> dict[str, Any]:
    p = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port,
         "remote_engine_id": "e", "transfer_id": "t",
         "prompt_digest": token_digest(prompt[:-1]).hex(), "expires": int(time.time()) + 60}
    p.update(over)
    sign = getattr(connector_mod, "sign_params", None)
    p["signature"] = sign(secret, p) if sign is not None else ""
    return p


def _request(rid: str, prompt: list[int], params: dict | None) -> Request:
    extra = {"kv_transfer_params": params} if params is not None else None
    return Request(rid, prompt, SamplingParams(max_tokens=2, temperature=0,
                                               extra_args=extra))


def _consumer(**cfg: Any) -> KVConnector:
    return KVConnector(parse_kv_transfer_config({"kv_role": "kv_consumer", "chunk_blocks": 2,
                                                 **cfg}),
                       _kv_cache(), block_size=4, secret=b"s3cret", host="127.0.0.1")


def test_only_params_signed_for_this_prompt_are_acted_on():
    prompt = list(range(3, 14))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    conn = _consumer()
    other: KVConnector | None = None
    try:
        bad = {
            "unsigned": {k: v for k, v in _signed(b"s3cret", port, prompt).items()
                         if k != "signature"},
            "other secret": _signed(b"api-key", port, prompt),
            "other prompt": _signed(b"s3cret", port, [9, 9, 9, 9, 9]),
            "expired": _signed(b"s3cret", port, prompt, expires=int(time.time()) - 1),
        }
        for i, (why, p) in enumerate(bad.items()):
            req = _request(f"r{i}", prompt, p)
            assert conn.num_external_tokens(req, 0) == 0, why
            conn.release_remote(req)        # nothing to release either: no connection
        assert conn.stats.params_ignored == len(bad)
        other = _consumer(prefill_endpoints=["127.0.0.1:1"])    # not this endpoint
        assert other.num_external_tokens(
            _request("x", prompt, _signed(b"s3cret", port, prompt)), 0) == 0
        assert conn.num_external_tokens(
            _request("ok", prompt, _signed(b"s3cret", port, prompt)), 0) == len(prompt) - 1
        other.close()
        other = _consumer(prefill_endpoints=[f"127.0.0.1:{port}"])
        assert other.num_external_tokens(
            _request("ok", prompt, _signed(b"s3cret", port, prompt)), 0) == len(prompt) - 1
        listener.settimeout(0.5)
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        conn.close()
        if other is not None:
            other.close()
        listener.close()


class _Fake:
    """The scheduler's connector: every request with params has all but one token remote."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.released: list[str] = []

    def num_external_tokens(self, request: Request, num_local: int) -> int:
        rid = request.request_id
        if request.sampling_params.extra_args is None or rid in self.started \
                or rid in self.released:
            return 0
        return request.num_prompt_tokens - 1 - num_local

    def start_load(self, request: Request, block_ids: list[int], num_local: int) -> None:
        self.started.append(request.request_id)

    def release_remote(self, request: Request) -> None:
        self.released.append(request.request_id)

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        pass

    def forget(self, req_id: str) -> None:
        pass


def test_pending_pulls_hold_at_most_their_share_of_the_pool():
    kv = KVCacheManager(16, 4)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                  block_size=4, connector=_Fake(),
                  max_loading_blocks=8)            # half of the pool
    for i in range(3):                             # 11 tokens: 10 remote, 3 blocks each
        s.add_request(_request(f"r{i}", [i + 3] * 11, {"do_remote_prefill": True}))
    out = s.schedule()
    assert set(s.loading) == {"r0", "r1"}
    assert out.num_scheduled_tokens == {"r2": 11}  # over the cap: computed here
    assert kv.num_free_blocks == 16 - 6 - 3
    s.finish_loading("r0", None)
    assert kv.num_free_blocks == 16 - 3 - 3
    kv.check()


def test_slow_producer_is_given_up_at_the_deadline():
    """A producer that trickles one byte every 0.2 s never trips a per-read timeout;
    the pull still ends (failed) at its deadline, and the thread serving the trickle
    stops."""
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]
    stop = threading.Event()

    def trickle() -> None:
        lsock.settimeout(10)
        conn, _ = lsock.accept()
        with conn:
            send_frame(conn, "kv-challenge", {"v": transport.VERSION, "nonce": b"n" * 32})
            recv_frame(conn, 4096)
            import msgpack
            body = msgpack.packb(("kv-refused", {"v": transport.VERSION,
                                                 "reason": "x" * 40}), use_bin_type=True)
            frame = len(body).to_bytes(4, "big") + body
            for b in frame:                        # ~10 s at this pace, if let run
                if stop.wait(0.2):
                    return
                try:
                    conn.sendall(bytes([b]))
                except OSError:
                    return

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    conn = _consumer(timeout=1.0)
    try:
        prompt = list(range(3, 14))
        req = _request("slow", prompt, _signed(b"s3cret", port, prompt))
        assert conn.num_external_tokens(req, 0) == 10
        t0 = time.monotonic()
        conn.start_load(req, [0, 1, 2], 0)
        loads: list = []
        while not loads and time.monotonic() - t0 < 15:
            conn.wait(0.05)
            loads = conn.finished_loads()
        elapsed = time.monotonic() - t0
        assert [ld.req_id for ld in loads] == ["slow"] and loads[0].error
        assert elapsed < 2.5, elapsed
        assert conn.stats.load_failures == 1
    finally:
        stop.set()
        t.join(5)
        conn.close()
        lsock.close()


# ---- the secret -------------------------------------------------------------------------

def test_transfer_secret_is_required_and_is_not_the_api_key(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    cfg = parse_kv_transfer_config({"kv_role": "kv_consumer"})
    with pytest.raises(ValueError, match=SECRET_ENV):
        read_secret(cfg, None)
    with pytest.raises(ValueError, match=SECRET_ENV):
        read_secret(cfg, "client-key")              # the API key does not stand in
    monkeypatch.setenv(SECRET_ENV, "client-key")
    with pytest.raises(ValueError, match="must not be the API key"):
        read_secret(cfg, "client-key")
    assert read_secret(cfg, "another-key") == b"client-key"
    f = tmp_path / "secret"
    f.write_text("from-a-file\n")
    with_file = parse_kv_transfer_config({"kv_role": "kv_both", "secret_file": str(f)})
    assert read_secret(with_file, "k") == b"from-a-file"


def test_serve_without_transfer_secret_fails_at_start_up(monkeypatch):
    env = {k: v for k, v in __import__("os").environ.items() if k != SECRET_ENV}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "jaxserve.cli", "serve", "--port", "0",
             "--kv-transfer-config", '{"kv_role": "kv_consumer"}'],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the server started without a transfer secret")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert SECRET_ENV in proc.stderr and "secret_file" in proc.stderr
    assert time.monotonic() - t0 < 60


# ---- the transfer port under idle peers -------------------------------------------------

GEOM = [2, 2, 4, 8, "<f4"]


def _transfer_server(store: SavedStore, **kw: Any) -> TransferServer:
    known = inspect.signature(TransferServer).parameters
    return TransferServer(store, lambda s: s.chunks[0][:, :, :, :s.num_blocks], GEOM,
                          host="127.0.0.1", port=0, secret=b"s3cret", timeout=5,
                          **{k: v for k, v in kw.items() if k in known})


def test_idle_connections_do_not_keep_a_transfer_out():
    store = SavedStore(1 << 20, ttl=60)
    srv = _transfer_server(store, handshake_timeout=1.0)
    idle: list[socket.socket] = []
    try:
        for _ in range(100):        # one peer address holding 100 connections, silent
            idle.append(socket.create_connection(("127.0.0.1", srv.port), timeout=5,
                                                 source_address=("127.0.0.2", 0)))
        time.sleep(0.3)             # accepted (or turned away) by now
        data = np.random.default_rng(0).standard_normal((2, 2, 2, 3, 4, 8)).astype(np.float32)
        digest = token_digest(list(range(10)))
        assert store.put("a", [data], 3, digest, data.nbytes)
        t0 = time.monotonic()
        got = fetch("127.0.0.1", srv.port, transfer_id="a", first_block=0, num_blocks=3,
                    digest=digest, geometry=GEOM, shape=(2, 2, 2, 3, 4, 8),
                    dtype=np.dtype(np.float32), secret=b"s3cret", timeout=5)
        np.testing.assert_array_equal(got, data)
        assert time.monotonic() - t0 < 2
        # the idle ones that got a slot lose it at the handshake deadline
        deadline = time.monotonic() + 5
        while srv.active and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.active == 0 and srv.turned_away >= 90
    finally:
        for s in idle:
            s.close()
        srv.close()


def test_data_mac_binds_the_prompt():
    """A server that knows the secret but vouches for another prompt's KV is refused."""
    secret = b"s3cret"
    lsock = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        lsock.settimeout(5)
        conn, _ = lsock.accept()
        with conn:
            nonce = b"n" * 32
            send_frame(conn, "kv-challenge", {"v": transport.VERSION, "nonce": nonce})
            _, req = recv_frame(conn, 4096)
            other = token_digest([1, 2, 3])
            payload = np.zeros((2, 2, 2, 1, 4, 8), np.float32).tobytes()
            crc = zlib.crc32(payload)
            msg = b"|".join((b"jaxserve-kv-data-v2", req["nonce"], nonce, b"t", other,
                             str(len(payload)).encode(), str(crc).encode()))
            send_frame(conn, "kv-data", {
                "v": transport.VERSION, "mac": hmac.new(secret, msg, hashlib.sha256).digest(),
                "digest": other, "shape": [2, 2, 2, 1, 4, 8], "dtype": "<f4",
                "wire": "native", "nbytes": len(payload), "crc32": crc})
            conn.sendall(payload)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with pytest.raises(transport.TransferError, match="another prompt"):
            fetch("127.0.0.1", lsock.getsockname()[1], transfer_id="t", first_block=0,
                  num_blocks=1, digest=token_digest([4, 5, 6]), geometry=GEOM,
                  shape=(2, 2, 2, 1, 4, 8), dtype=np.dtype(np.float32), secret=secret,
                  timeout=5)
    finally:
        t.join(5)
        lsock.close()
