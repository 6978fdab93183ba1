"""The KV offload tiers on their own: the host tier's byte bound and LRU; the disk tier's
file format (a damaged or foreign file is a miss and is deleted), its byte bound, its
turning off on a full disk or an unwritable directory, and two processes sharing one
directory (atomic writes: a reader sees a whole block or none); the /metrics names."""
from __future__ import annotations

import errno
import hashlib
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.kv_transfer.offload_tiers import HEADER, DiskTier, HostTier
from jaxserve.server.metrics import ServerMetrics

ROW = 256
FP = b"m" * 32
LAYOUT = b"l" * 32


def h(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=32).digest()


def row(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, ROW, dtype=np.uint8)


def disk(path: Path, max_bytes: int = 1 << 20, fp: bytes = FP) -> DiskTier:
    return DiskTier(path, max_bytes, fp, LAYOUT, ROW)


def test_host_tier_stays_within_its_bound_and_evicts_least_recently_used():
    tier = HostTier(3 * ROW + 10)
    for i in range(3):
        assert tier.put(h(i), row(i))
    assert tier.get(h(0)) is not None          # 0 is now the most recent
    tier.put(h(3), row(3))                      # evicts 1, the least recent
    assert h(1) not in tier and all(h(i) in tier for i in (0, 2, 3))
    for i in range(4, 40):
        tier.put(h(i), row(i))
        assert tier.nbytes <= tier.max_bytes
    assert len(tier) == 3 and tier.nbytes == 3 * ROW
    assert not HostTier(ROW - 1).put(h(0), row(0)), "a row larger than the bound is kept"
    np.testing.assert_array_equal(tier.get(h(39)), row(39))


def test_disk_round_trip_survives_a_new_instance(tmp_path):
    a = disk(tmp_path)
    assert a.write(h(1), row(1)) and not a.write(h(1), row(1))   # the second is skipped
    b = disk(tmp_path)                          # a restarted engine
    assert b.key == a.key and len(b.key) == 32, "engines on one directory share the key"
    assert h(1) in b and h(2) not in b
    np.testing.assert_array_equal(b.read(h(1)), row(1))
    assert not list(tmp_path.glob(".tmp*")), "a temporary file was left behind"


@pytest.mark.parametrize("damage", ["truncated", "bit_flip", "other_model", "header_flip"])
def test_a_damaged_or_foreign_file_is_a_miss_and_is_deleted(tmp_path, damage):
    writer = disk(tmp_path, fp=b"x" * 32) if damage == "other_model" else disk(tmp_path)
    writer.write(h(1), row(1))
    path = writer.path(h(1))
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[:-7]
    elif damage == "bit_flip":
        data[HEADER.size + 100] ^= 0x10
    elif damage == "header_flip":
        data[20] ^= 0x01                        # inside the fingerprint
    path.write_bytes(bytes(data))
    reader = disk(tmp_path)
    assert h(1) in reader
    assert reader.read(h(1)) is None
    assert not path.exists() and h(1) not in reader and reader.corrupt == 1


def test_disk_tier_stays_within_its_bound(tmp_path):
    tier = disk(tmp_path, max_bytes=5 * (HEADER.size + ROW))
    for i in range(20):
        tier.write(h(i), row(i))
        assert tier.nbytes <= tier.max_bytes
    files = list(tmp_path.glob("*.kvb"))
    assert len(files) == 5 and tier.nbytes == sum(f.stat().st_size for f in files)
    assert all(h(i) in tier for i in range(15, 20))     # the newest are kept
    # a restart over more files than its bound deletes the oldest
    small = disk(tmp_path, max_bytes=2 * (HEADER.size + ROW))
    assert len(list(tmp_path.glob("*.kvb"))) == 2 and small.nbytes <= small.max_bytes


def test_full_disk_turns_the_tier_off_with_one_log_line(tmp_path, monkeypatch, caplog):
    tier = disk(tmp_path)
    assert tier.write(h(0), row(0))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr("builtins.open", full)
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        assert not tier.write(h(1), row(1))
        assert not tier.write(h(2), row(2))
    monkeypatch.undo()
    assert not tier.enabled and h(0) not in tier, "a turned-off tier still answers"
    assert len([r for r in caplog.records if "turned off" in r.message]) == 1
    assert not list(tmp_path.glob(".tmp*"))


def test_unwritable_directory_turns_the_tier_off(tmp_path, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        tier = disk(blocker / "kv")
    assert not tier.enabled and not tier.write(h(0), row(0)) and h(0) not in tier
    assert len([r for r in caplog.records if "turned off" in r.message]) == 1


_WORKER = r"""
import sys, hashlib
import numpy as np
from jaxserve.kv_transfer.offload_tiers import DiskTier
path, seed = sys.argv[1], int(sys.argv[2])
ROW = 1 << 16
tier = DiskTier(path, 1 << 30, b"m" * 32, b"l" * 32, ROW)
h = lambda i: hashlib.blake2b(str(i).encode(), digest_size=32).digest()
row = lambda i: np.full(ROW, i % 251, np.uint8)
bad = 0
for rnd in range(3):
    for i in range(40):
        j = (i * (seed + 1) + rnd) % 40
        if seed % 2 == 0:
            tier.write(h(j), row(j))
        elif h(j) in tier:
            r = DiskTier(path, 1 << 30, b"m" * 32, b"l" * 32, ROW).read(h(j))
            bad += r is None or not np.array_equal(r, row(j))
print(bad, tier.corrupt)
"""


def test_two_processes_share_one_directory_atomically(tmp_path):
    """Two writers and two readers at once on the same blocks: no reader ever finds a
    partial or wrong block (it would count it corrupt), and every block ends whole."""
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(tmp_path), str(s)],
                              stdout=subprocess.PIPE, text=True) for s in range(4)]
    outs = [p.communicate(timeout=60)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert all(o == ["0", "0"] for o in outs), outs
    tier = DiskTier(tmp_path, 1 << 30, FP, LAYOUT, 1 << 16)
    assert len(list(tmp_path.glob("*.kvb"))) == 40 and not list(tmp_path.glob(".tmp*"))
    for i in range(40):
        np.testing.assert_array_equal(tier.read(h(i)), np.full(1 << 16, i % 251, np.uint8))


def test_offload_metrics_names():
    snap = dict(num_running=0, num_waiting=0, kv_usage=0.0, prefix_queries=100,
                prefix_hits=40, num_preemptions=0, num_compiles=0, steps=1, errored=False,
                offload_host_queries=60, offload_host_hits=32, offload_disk_queries=28,
                offload_disk_hits=16, offload_bytes_to_host=1000, offload_bytes_to_device=500,
                offload_bytes_to_disk=700, offload_bytes_from_disk=300,
                offload_host_bytes=900, offload_disk_bytes=2000)
    m = ServerMetrics("m", lambda: snap, compat="vllm")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(m.render().decode())
               for s in f.samples}

    def get(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"model_name": "m", **labels}.items())))]
    assert get("vllm:external_prefix_cache_queries_total", engine="0") == 60
    assert get("vllm:external_prefix_cache_hits_total", engine="0") == 48
    assert get("jaxserve:kv_offload_hits_total", tier="device") == 40
    assert get("jaxserve:kv_offload_queries_total", tier="disk") == 28
    assert get("jaxserve:kv_offload_hits_total", tier="host") == 32
    assert get("jaxserve:kv_offload_bytes_total", direction="host_to_device") == 500
    assert get("jaxserve:kv_offload_bytes_total", direction="disk_to_host") == 300
    assert get("jaxserve:kv_offload_used_bytes", tier="disk") == 2000
