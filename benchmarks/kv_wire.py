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

import numpy as np

from .harness import KVPullRig


def pull_ms(n: int, wire: str, reps: int) -> float:
    rig = KVPullRig(2 * n + 2, random_values=True)
    try:
        times = [rig.pull(n, wire) for _ in range(reps + 1)]     # the first is a warm-up
    finally:
        rig.close()
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
