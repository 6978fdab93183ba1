"""The analytic memory model of the attention kernels (jaxserve/tools/kernel_model.py):
sanity and monotonic properties, one example worked by hand, the CLI."""
from __future__ import annotations

import dataclasses

import pytest

from jaxserve.tools import kernel_model as km

SHIPPED_V5E = km.Workload(rows=64, context=2048, tp=8)


def test_worked_example_v3_on_v5e_tp8():
    """tpu-v3, v5e, TP=8 (one bf16 kv head of 128 dims per chip), 32-token pages, 64 rows
    of 2048 tokens. Chunk: 512 tokens = 16 pages; K and V apart: 32 DMAs of 32 * 128 * 2 =
    8 KiB; 256 KiB a chunk, one in flight. Latency: 1 us + 32 * 20 ns + 262144 B / 819
    GB/s = 1.96 us; issue: 32 * 20 ns + 32 waits * 50 ns + 0.35 us / 4 chunks = 2.3275 us,
    the larger; 4 chunks a row, 64 rows; plus the fused write's exposed prologue (1 us +
    128 DMAs * 20 ns) and the 2 us call."""
    e = km.estimate("v5e", SHIPPED_V5E, km.KernelConfig("tpu-v3", page_size=32))
    assert 1e-6 + 32 * 20e-9 + 262144 / 819e9 < 2.3275e-6
    period = 32 * 20e-9 + 32 * 50e-9 + 0.35e-6 / 4
    seconds = 2e-6 + (1e-6 + 128 * 20e-9) + 64 * 4 * period
    assert (e.dma_bytes, e.transfer_bytes, e.in_flight, e.bound) == (8192, 262144, 1, "issue")
    assert e.bytes_moved == 64 * 2048 * 2 * 128 * 2
    assert e.dmas == 64 * 4 * 32 + 128
    assert e.seconds == pytest.approx(seconds, rel=1e-12)
    assert e.share == pytest.approx(e.bytes_moved / seconds / 819e9)
    assert 0.13 < e.share < 0.14


def test_page_major_kernel_meets_the_target_on_shipped_tpu_configs():
    pm = km.estimate("v5e", SHIPPED_V5E, km.KernelConfig("tpu-pm", page_size=32))
    assert pm.share >= 0.60
    assert pm.dma_bytes == 2 * 32 * 128 * 2 and pm.bytes_in_flight >= 2 * 2 ** 20
    v6e = km.estimate("v6e", km.Workload(64, 2048, tp=4), km.KernelConfig("tpu-pm", page_size=32))
    assert v6e.share >= 0.60
    for chip, wl in (("v5e", SHIPPED_V5E), ("v6e", km.Workload(64, 2048, tp=4))):
        v3 = km.estimate(chip, wl, km.KernelConfig("tpu-v3", page_size=32))
        assert v3.share < 0.35


@pytest.mark.parametrize("kernel", km.KERNELS)
def test_sanity(kernel):
    chip = "h200" if kernel in km.GPU_KERNELS else "v5e"
    wl = km.Workload(rows=8, context=3000, tp=2)
    e = km.estimate(chip, wl, km.KernelConfig(kernel, page_size=16))
    assert 0 < e.share <= 1.0
    assert e.seconds >= e.bytes_moved / km.CHIPS[chip].hbm_bytes_per_s
    assert e.bytes_moved >= wl.rows * wl.context * wl.token_bytes
    assert e.dmas > 0 and e.bytes_in_flight == e.in_flight * e.transfer_bytes


def test_monotonic():
    def share(chip="v5e", wl=SHIPPED_V5E, **kw):
        return km.estimate(chip, wl, km.KernelConfig(**kw)).share

    # more transfers in flight never hurt; bigger pages mean fewer, larger DMAs
    assert share(kernel="tpu-pm", page_size=32, in_flight=1) < share(kernel="tpu-pm",
                                                                      page_size=32)
    assert share(kernel="tpu-v3", page_size=32, in_flight=2) >= share(kernel="tpu-v3", page_size=32)
    pages = [share(kernel="tpu-pm", page_size=bs) for bs in (16, 32, 64, 128)]
    assert pages == sorted(pages)
    dmas = [km.estimate("v5e", SHIPPED_V5E, km.KernelConfig("tpu-pm", bs)).dmas
            for bs in (16, 64)]
    assert dmas[0] > dmas[1]
    # twice the bandwidth at the same latency: at most twice as fast
    wl = km.Workload(64, 2048, tp=4)
    t5 = km.estimate("v5e", wl, km.KernelConfig("tpu-pm", 32)).seconds
    t6 = km.estimate("v6e", wl, km.KernelConfig("tpu-pm", 32)).seconds
    assert t5 / 2 <= t6 < t5
    # split-K fixes the one-long-row case on a GPU; bytes scale with rows
    one = km.Workload(1, 8192)
    assert share("h200", one, kernel="gpu-splitk") > 5 * share("h200", one, kernel="gpu-tiled")
    e1 = km.estimate("v5e", dataclasses.replace(SHIPPED_V5E, rows=8), km.KernelConfig("tpu-pm", 32))
    e2 = km.estimate("v5e", SHIPPED_V5E, km.KernelConfig("tpu-pm", 32))
    assert e2.bytes_moved == 8 * e1.bytes_moved


def test_int8_cache_counts_scales():
    wl = dataclasses.replace(SHIPPED_V5E, dtype="int8")
    assert wl.token_bytes == 2 * (128 + 4)
    bf = km.estimate("v5e", SHIPPED_V5E, km.KernelConfig("tpu-pm", 32))
    q8 = km.estimate("v5e", wl, km.KernelConfig("tpu-pm", 32))
    assert q8.bytes_moved < bf.bytes_moved and q8.dmas > bf.dmas


def test_cli(capsys):
    assert km.main(["--kernel", "tpu-pm", "--chip", "v5e", "--tp", "8", "--page-size", "32"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == km.HEADER and len(out) == 3 and "tpu-pm" in out[2]
    assert km.main(["--review"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 2 + 2 * 3 + 3 * 2
    with pytest.raises(SystemExit):
        km.main(["--kernel", "gpu-tiled", "--chip", "v5e"])
