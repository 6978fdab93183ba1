"""KV transfer with the blocks sent natively vs as int8 (kv_transfer/wire.py), side by
side on loopback: SmolLM2-135M's KV geometry (30 layers, 3 KV heads, block 16, head dim
64, float32; 720 KiB a block), each pull = gather on the producer, the stream with its
handshake and CRC (+ int8 encode / decode), scatter on the consumer.

    python -m benchmarks.kv_wire [--blocks 1 16 48] [--reps 5]

Loopback moves bytes at memory speed, so this shows the encode/decode cost int8 adds
and the bytes it saves, not the gain on a real network (there a pull's time is about
bytes / bandwidth: int8 sends 0.27 of them).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def pull_ms(n: int, wire: str, reps: int) -> float:
    import jax
    import jax.numpy as jnp

    from jaxserve.kv_transfer.blocks import BlockMover
    from jaxserve.kv_transfer.transport import SavedStore, TransferServer, fetch
    L, K, NB, S, H = 30, 3, 2 * n + 2, 16, 64
    rng = np.random.default_rng(0)
    kv = [tuple(jnp.asarray(rng.standard_normal((K, NB, S, H), np.float32)) for _ in "kv")
          for _ in range(L)]
    dst = [(jnp.zeros_like(k), jnp.zeros_like(v)) for k, v in kv]
    mover = BlockMover(kv, 16)
    dst = mover.warmup(dst)
    store = SavedStore(1 << 34, 60)
    geom = [L, K, S, H, "<f4"]
    srv = TransferServer(store, lambda s: mover.to_host(s.chunks, s.num_blocks), geom,
                         host="127.0.0.1", port=0, secret=b"bench", timeout=60)
    times = []
    try:
        for i in range(reps + 1):           # the first is a warm-up
            t0 = time.perf_counter()
            store.put(str(i), mover.gather(kv, list(range(n))), n, b"d",
                      n * mover.bytes_per_block)
            data = fetch("127.0.0.1", srv.port, transfer_id=str(i), first_block=0,
                         num_blocks=n, digest=b"d", geometry=geom, shape=mover.host_shape(n),
                         dtype=mover.dtype, secret=b"bench", timeout=60, wire=wire)
            dst = mover.scatter(dst, list(range(n, 2 * n)), data)
            jax.block_until_ready(dst)
            times.append(time.perf_counter() - t0)
    finally:
        srv.close()
    return float(np.median(times[1:])) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 16, 48])
    p.add_argument("--reps", type=int, default=5)
    ns = p.parse_args()
    from jaxserve.kv_transfer.wire import nbytes
    rows = []
    for n in ns.blocks:
        shape = (30, 2, 3, n, 16, 64)
        row = {"blocks": n, "load_avg": os.getloadavg()[0]}
        for wire in ("native", "int8", "native", "int8"):     # alternated, median each
            row.setdefault(wire, []).append(pull_ms(n, wire, ns.reps))
        for wire in ("native", "int8"):
            row[f"{wire}_ms"] = float(np.median(row.pop(wire)))
            row[f"{wire}_mib"] = nbytes(shape, np.dtype(np.float32), wire) / 2**20
        rows.append(row)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
