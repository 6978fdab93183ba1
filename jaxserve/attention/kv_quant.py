"""Quantized KV cache (`--kv-cache-dtype int8|fp8`): values plus per-(token, head) scales.

One layer's k (or v) cache is then a QuantizedKV pytree instead of one array:

    values  [K, NB, bs, H]  int8 (symmetric, scale = max|x| / 127) or
                            float8_e4m3fn (scale = max|x| / 448)
    scales  [K, NB, bs]     float32; x ~= values * scales[..., None]

Why per (token, head) and not per block: a block fills one token at a time, so a block
scale would either be fixed in advance (calibration we do not have) or force rewriting
the whole block whenever a new token raises its max; a per-token scale is written once
with its token, by the same scatter (or fused kernel DMA) as the values. The scales
cost 4 / H bytes per value (6% of int8 at H = 64, 3% at H = 128).

Both parts are ordinary leaves: jit donation, `jax.tree.map`, and sharding (the scales
are sharded like the values on the head axis, `leaf_shardings`) see a plain pytree.
`shape` / `dtype` read like the values' so code that sizes things from a cache works.
"""
from __future__ import annotations

from typing import Any

from flax import struct
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
# largest magnitude each storage type represents (the scale maps max|x| onto it)
QMAX = {"int8": 127.0, "fp8": 448.0}
STORAGE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


@struct.dataclass(slots=True)
class QuantizedKV:
    values: Any     # [K, NB, bs, H] int8 | float8_e4m3fn
    scales: Any     # [K, NB, bs] float32

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def dtype(self) -> Any:
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes) + int(self.scales.nbytes)


def is_quantized(cache: Any) -> bool:
    return isinstance(cache, QuantizedKV)


def kind_of(dtype: Any) -> str:
    """'int8' or 'fp8' for a storage dtype."""
    return "int8" if jnp.dtype(dtype) == jnp.int8 else "fp8"


def check_kv_cache_dtype(name: str | None) -> str:
    """'auto' (the compute dtype), 'int8' or 'fp8'; anything else is a user error."""
    name = name or "auto"
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r}: choose one of {KV_CACHE_DTYPES}")
    return name


def bytes_per_slot_head(kv_cache_dtype: str, head_dim: int, compute_dtype: Any) -> int:
    """Bytes one (token, kv head) takes in one of k / v."""
    if kv_cache_dtype == "auto":
        return head_dim * jnp.dtype(compute_dtype).itemsize
    return head_dim * 1 + 4          # 1-byte values + one float32 scale


def quantize(x: jax.Array, kind: str) -> tuple[jax.Array, jax.Array]:
    """x [..., H] -> (values [..., H] in the storage type, scales [...] float32)."""
    xf = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(xf), axis=-1) / QMAX[kind]
    safe = jnp.where(scale > 0, scale, 1.0)[..., None]
    y = jnp.clip(xf / safe, -QMAX[kind], QMAX[kind])
    if kind == "int8":
        return jnp.round(y).astype(jnp.int8), scale
    return _to_e4m3(y), scale


def quantize_for_cache(x: jax.Array, storage_dtype: Any) -> tuple[jax.Array, jax.Array]:
    """quantize(x) into a cache stored as storage_dtype (the TPU kernel's fused write
    takes this: the kernels do not know the cache format)."""
    return quantize(x, kind_of(storage_dtype))


def _to_e4m3(y: jax.Array) -> jax.Array:
    """float32 in [-448, 448] -> float8_e4m3fn, rounding to nearest even, in integer
    arithmetic: equal to `astype` (tested, ties included), which XLA:CPU runs ~30x slower
    inside the step's fusions. Normal range: round the float32 bits to 3 mantissa bits
    (a carry moves the exponent up) and rebias the exponent (127 -> 7); below 2^-6, the
    subnormal steps of 2^-9."""
    a = jnp.abs(y)
    bits = jax.lax.bitcast_convert_type(a, jnp.uint32)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    sub = jnp.round(a * 512.0).astype(jnp.uint32)
    mag = jnp.where(a < 2.0 ** -6, sub, normal)
    sign = (jax.lax.bitcast_convert_type(y, jnp.uint32) >> 31) << 7
    return jax.lax.bitcast_convert_type((sign | mag).astype(jnp.uint8), jnp.float8_e4m3fn)


def dequantize(values: jax.Array, scales: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    """values [..., H], scales [...] -> [..., H] in dtype (computed in float32)."""
    return (values.astype(jnp.float32) * scales[..., None]).astype(dtype)


def fake_quantize(x: jax.Array, kind: str) -> jax.Array:
    """x as it reads back from a quantized cache (same dtype as x)."""
    return dequantize(*quantize(x, kind), x.dtype)


def zeros(shape: tuple[int, int, int, int], kind: str) -> QuantizedKV:
    return QuantizedKV(jnp.zeros(shape, STORAGE[kind]), jnp.zeros(shape[:3], jnp.float32))


def init_layer(shape: tuple[int, int, int, int], kv_cache_dtype: str, dtype: Any) -> Any:
    """One zeroed k (or v) cache: a plain array ('auto') or a QuantizedKV."""
    if kv_cache_dtype == "auto":
        return jnp.zeros(shape, dtype)
    return zeros(shape, kv_cache_dtype)


def leaf_shardings(sharding: NamedSharding, kv_cache_dtype: str) -> Any:
    """The sharding of one k (or v) cache as a pytree matching init_layer's result: the
    scales take the values' spec without the head_dim entry (same head-axis split)."""
    if kv_cache_dtype == "auto":
        return sharding
    spec = tuple(sharding.spec)[:3]
    return QuantizedKV(sharding, NamedSharding(sharding.mesh, PartitionSpec(*spec)))


def _bytes(x: jax.Array) -> jax.Array:
    """A 1-byte array viewed as uint8. XLA:CPU scatters into a float8 cache far slower
    than into bytes (docs/benchmarks.md, "Measurements behind code choices"),
    so fp8 values move as bytes and are viewed back."""
    return jax.lax.bitcast_convert_type(x, jnp.uint8) if x.dtype != jnp.int8 else x


def _unbytes(x: jax.Array, dtype: Any) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def gather(cache: QuantizedKV, index: Any, dtype: Any) -> jax.Array:
    """cache[:, index] dequantized to dtype ([K, *index.shape, bs, H])."""
    vals = _unbytes(_bytes(cache.values)[:, index], cache.values.dtype)
    return dequantize(vals, cache.scales[:, index], dtype)


def write(cache: QuantizedKV, new: jax.Array, slot_mapping: jax.Array) -> QuantizedKV:
    """Quantize new [T, K, H] and scatter it (values and scales) at flat slots [T]."""
    K, B, bs, H = cache.values.shape
    q, s = quantize(new, kind_of(cache.values.dtype))
    vals = _bytes(cache.values).reshape(K, B * bs, H).at[:, slot_mapping].set(
        _bytes(q).swapaxes(0, 1), mode="drop")
    vals = _unbytes(vals, cache.values.dtype)
    scales = cache.scales.reshape(K, B * bs).at[:, slot_mapping].set(
        s.swapaxes(0, 1), mode="drop")
    return QuantizedKV(vals.reshape(K, B, bs, H), scales.reshape(K, B, bs))
