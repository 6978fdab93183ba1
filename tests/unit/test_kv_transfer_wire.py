"""int8 KV transfer (`wire_dtype`: kv_transfer/wire.py): the codec's rounding
stays within half a step of a per-token-and-head absmax scale computed here in float64,
the bytes shrink to about a quarter (head_dim 64), 1-byte caches travel as they are, and over the real
TCP stream a decode server that asks for int8 gets that data while one that asks for
nothing gets the exact bytes."""
from __future__ import annotations

import numpy as np
import pytest

from jaxserve.kv_transfer.config import parse_kv_transfer_config
from jaxserve.kv_transfer.transport import SavedStore, TransferServer, fetch, token_digest
from jaxserve.kv_transfer.wire import decode, encode, nbytes

SHAPE = (2, 2, 3, 4, 16, 64)        # [L, 2, K, n, S, H]
GEOM = [2, 3, 16, 64, "<f4"]


def _data(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # magnitudes differ per token and head, as real K/V do: one scale for all would not do
    spread = np.exp(rng.uniform(-4, 3, SHAPE[:5]))[..., None]
    x = (rng.standard_normal(SHAPE) * spread).astype(np.float32)
    x[1, 0, 2, 3, 5] = 0.0              # an all-zero head vector
    return x


def _half_steps(x: np.ndarray) -> np.ndarray:
    """Half a quantization step per element: absmax / 127 / 2 of its token's head."""
    bound = np.empty(x.shape[:5])
    for idx in np.ndindex(*x.shape[:5]):
        bound[idx] = float(np.max(np.abs(x[idx].astype(np.float64)))) / 127.0 / 2.0
    return np.broadcast_to(bound[..., None], x.shape)


def test_int8_round_trip_within_half_a_step_and_a_quarter_of_the_bytes():
    x = _data()
    used, payload = encode(x, "int8")
    assert used == "int8" and payload.nbytes == nbytes(SHAPE, x.dtype, "int8")
    assert payload.nbytes / x.nbytes < 0.27     # 64 values + one 4-byte scale per head
    y = decode(bytes(payload), SHAPE, x.dtype, "int8")
    assert y.dtype == np.float32 and y.shape == SHAPE
    err = np.abs(y.astype(np.float64) - x)
    assert np.all(err <= _half_steps(x) * (1 + 1e-4) + 1e-30)
    assert np.all(y[1, 0, 2, 3, 5] == 0.0)
    assert not np.array_equal(y, x)             # lossy: it really was int8


def test_native_and_one_byte_caches_travel_as_they_are():
    x = _data(1)
    used, payload = encode(x, "native")
    assert used == "native"
    np.testing.assert_array_equal(decode(bytes(payload), SHAPE, x.dtype, used), x)
    q = np.random.default_rng(2).integers(-127, 128, SHAPE).astype(np.int8)
    used, payload = encode(q, "int8")
    assert used == "native" and payload.nbytes == q.nbytes


def _fetch(port: int, tid: str, digest: bytes, wire: str) -> np.ndarray | None:
    return fetch("127.0.0.1", port, transfer_id=tid, first_block=1, num_blocks=3,
                 digest=digest, geometry=GEOM, shape=(2, 2, 3, 3, 16, 64),
                 dtype=np.dtype(np.float32), secret=b"s", timeout=5, wire=wire)


def test_stream_carries_int8_when_asked_and_exact_bytes_otherwise():
    x = _data(3)
    store = SavedStore(1 << 24, ttl=60)
    srv = TransferServer(store, lambda s: s.chunks[0][:, :, :, :s.num_blocks], GEOM,
                         host="127.0.0.1", port=0, secret=b"s", timeout=5)
    digest = token_digest([1, 2, 3])
    try:
        assert store.put("a", [x], 4, digest, x.nbytes)
        got = _fetch(srv.port, "a", digest, "int8")
        want = x[:, :, :, 1:4]
        assert got is not None and not np.array_equal(got, want)
        assert np.all(np.abs(got - want) <= _half_steps(want) * (1 + 1e-4) + 1e-30)
        assert len(store) == 0                  # taken: released as before
        assert store.put("b", [x], 4, digest, x.nbytes)
        np.testing.assert_array_equal(_fetch(srv.port, "b", digest, "native"), want)
    finally:
        srv.close()


def test_wire_dtype_setting():
    assert parse_kv_transfer_config({"kv_role": "kv_consumer"}).wire_dtype == "native"
    cfg = parse_kv_transfer_config('{"kv_role": "kv_consumer", "wire_dtype": "int8"}')
    assert cfg.wire_dtype == "int8"
    with pytest.raises(ValueError, match="wire_dtype must be one of"):
        parse_kv_transfer_config({"kv_role": "kv_consumer", "wire_dtype": "fp8"})
