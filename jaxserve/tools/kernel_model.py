"""Analytic memory model of the ragged paged attention kernels on a KV-streaming
(decode-shaped) workload: bytes moved, DMA count and size, bytes in flight, and the
expected share of peak HBM bandwidth.

    python -m jaxserve.tools.kernel_model --kernel tpu-pm --chip v5e --tp 8 \\
        --rows 64 --context 2048 --page-size 32
    jaxserve tools kernel-model --review         # the design review's table, markdown

Pure Python (no jax). Nothing here is measured: CHIPS holds datasheet bandwidths and
stated latency assumptions, and every number printed follows from them.

Latency model. A kernel streams each row's KV as a sequence of transfers ("chunks" on
TPU, loop steps of one program on GPU). A transfer of B bytes issued as n DMAs
completes L + n * t_issue + B / BW after its first DMA is issued (HBM latency, the
scalar core pushing descriptors one by one, the bytes at peak). With d transfers kept
in flight (Little's law) one transfer retires every

    period = max(B / BW,                                   bandwidth
                 (L + n * t_issue + B / BW) / d,           latency
                 n * t_issue + w * t_wait + t_step / chunks)   issue (TPU scalar core)

(w: semaphore waits per chunk: v3 waits for each DMA, the page-major kernel once)

and the share of peak is B / period / BW. A TPU kernel is one sequential chain of
chunks over every row (prefetch crosses rows), preceded by what its fused KV write
exposes: v3 writes every row's new tokens before reading (L + 2 * rows * t_issue),
the page-major kernel only row 0's (the rest overlaps the reads). A GPU kernel runs
programs in waves of at most SMs x CTAs-per-SM (shared memory bounds CTAs); a wave of
a programs runs max(a * bytes / BW, L_step * (1 + (steps - 1) / d)), with L_step = L
plus, where the page index is loaded in the same step (the tiled and split-K kernels
gather through the block table), the index load's latency. Compute is assumed hidden
(decode is HBM-bound); prefill is out of scope.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Sequence

from kernels_pallas.ragged_paged_attention import pm_tuning

KIB, MIB = 2 ** 10, 2 ** 20


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes_per_s: float      # datasheet peak
    latency_s: float            # HBM -> VMEM/SMEM transfer latency (assumed)
    issue_s: float = 0.0        # TPU: scalar-core time to issue one DMA descriptor
    wait_s: float = 0.0         # TPU: one semaphore wait
    step_s: float = 0.0         # TPU: Pallas grid-step overhead
    index_latency_s: float = 0.0  # GPU: a block-table load (L2-resident)
    sms: int = 0                # GPU
    smem_per_sm: int = 0        # GPU shared memory bytes per SM
    call_s: float = 0.0         # one kernel launch / pallas_call


CHIPS = {
    "v5e": Chip("TPU v5e", 819e9, latency_s=1.0e-6, issue_s=20e-9, wait_s=50e-9,
                step_s=0.35e-6, call_s=2e-6),
    "v6e": Chip("TPU v6e", 1640e9, latency_s=1.0e-6, issue_s=20e-9, wait_s=50e-9,
                step_s=0.35e-6, call_s=2e-6),
    "h200": Chip("H200", 4.8e12, latency_s=0.8e-6, index_latency_s=0.5e-6, sms=132,
                 smem_per_sm=228 * KIB, call_s=3e-6),
}
TPU_KERNELS = ("tpu-v3", "tpu-pm")
GPU_KERNELS = ("gpu-tiled", "gpu-splitk", "gpu-paged")
KERNELS = TPU_KERNELS + GPU_KERNELS
ITEMSIZE = {"bfloat16": 2, "float32": 4, "int8": 1, "fp8": 1}
# kernel_tpu_v3.BLOCK_TABLE's decode chunk (tokens) and its VMEM cap, as data
V3_DECODE_CHUNK_TOKENS = {"v5e": 512, "v6e": 1024, "default": 512}
V3_KV_BUFFER_BYTES = 8 * MIB


@dataclasses.dataclass(frozen=True)
class Workload:
    rows: int = 64
    context: int = 2048
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    tp: int = 1

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.kv_heads // self.tp)

    @property
    def token_bytes(self) -> int:
        """K + V bytes of one token on one chip (int8/fp8 add a float32 scale each)."""
        per = self.head_dim * ITEMSIZE[self.dtype] + (4 if ITEMSIZE[self.dtype] == 1 else 0)
        return 2 * self.local_kv_heads * per


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    kernel: str
    page_size: int = 16
    chunk_bytes: int | None = None     # tpu-pm: byte budget (default pm_tuning)
    chunk_pages: int | None = None     # tpu-v3 / tpu-pm: pages per chunk override
    in_flight: int | None = None       # transfers in flight (default per kernel)
    splits: int | None = None          # gpu-splitk (default the engine's rule)
    block_kv: int = 64                 # gpu-tiled / gpu-splitk loop step (tokens)
    pages_per_step: int = 4            # gpu-paged
    num_stages: int = 2                # gpu-tiled / gpu-splitk (gpu-paged: 3)


@dataclasses.dataclass
class Estimate:
    kernel: str
    bytes_moved: int
    dmas: int
    dma_bytes: int
    transfer_bytes: int       # one chunk / loop step
    in_flight: int            # transfers in flight
    bytes_in_flight: int
    seconds: float
    bound: str
    peak: float

    @property
    def share(self) -> float:
        return self.bytes_moved / self.seconds / self.peak


def _period(chip: Chip, B: int, n: int, d: int, step_per_chunk: float,
            waits: int = 1) -> tuple[float, str]:
    bw = B / chip.hbm_bytes_per_s
    bounds = {"bandwidth": bw,
              "latency": (chip.latency_s + n * chip.issue_s + bw) / d,
              "issue": n * chip.issue_s + waits * chip.wait_s + step_per_chunk}
    name = max(bounds, key=lambda k: bounds[k])
    return bounds[name], name


def tpu_estimate(chip_key: str, wl: Workload, cfg: KernelConfig) -> Estimate:
    chip = CHIPS[chip_key]
    bs, tb = cfg.page_size, wl.token_bytes
    item = ITEMSIZE[wl.dtype]
    quant = item == 1
    if cfg.kernel == "tpu-v3":
        tokens = min(V3_DECODE_CHUNK_TOKENS.get(chip_key, 512),
                     max(bs, V3_KV_BUFFER_BYTES // (2 * 2 * wl.local_kv_heads * wl.head_dim * item)))
        pages = cfg.chunk_pages or max(1, tokens // bs)
        dmas_per_page = 4 if quant else 2            # K and V (and their scales) apart
        depth = cfg.in_flight or 1
        waits_per_page = dmas_per_page               # it waits for every DMA
    else:
        dt = {"fp8": "float8_e4m3fn"}.get(wl.dtype, wl.dtype)
        _, budget = pm_tuning.lookup(chip_key, wl.head_dim, dt, "decode")
        budget = cfg.chunk_bytes or budget
        pb = pm_tuning.page_bytes(wl.local_kv_heads, bs, wl.head_dim, item)
        pages = cfg.chunk_pages or min(max(1, budget // pb),
                                       max(1, pm_tuning.VMEM_KV_BYTES // (3 * pb)))
        dmas_per_page = 2 if quant else 1            # the whole page (and its scales)
        depth = cfg.in_flight or 2
        waits_per_page = 0                           # one byte-counted wait per chunk
    row_pages = math.ceil(wl.context / bs)
    pages = min(pages, row_pages)
    chunks = math.ceil(row_pages / pages)
    B = pages * bs * tb
    n = pages * dmas_per_page
    waits = pages * waits_per_page or (2 if quant else 1)
    period, bound = _period(chip, B, n, depth, chip.step_s / chunks, waits)
    # a row's last chunk holds the rest of its pages (its last page whole: pages move whole)
    last_pages = row_pages - (chunks - 1) * pages
    last, _ = _period(chip, last_pages * bs * tb, last_pages * dmas_per_page, depth,
                      chip.step_s / chunks, last_pages * waits_per_page or (2 if quant else 1))
    row_bytes = wl.context * tb
    row_time = (chunks - 1) * period + last
    writes = wl.rows * (2 if cfg.kernel == "tpu-v3" else 1) * (2 if quant else 1)
    exposed = (chip.latency_s + writes * chip.issue_s if cfg.kernel == "tpu-v3"
               else chip.latency_s + (2 if quant else 1) * chip.issue_s)
    seconds = chip.call_s + exposed + wl.rows * row_time
    return Estimate(cfg.kernel, wl.rows * row_bytes, wl.rows * chunks * n + writes,
                    B // n, B, depth, depth * B, seconds, bound, chip.hbm_bytes_per_s)


def choose_splits(rows: int, kv_heads: int, sms: int) -> int:
    """kernel_splitk.choose_num_splits for a decode bucket."""
    work = rows * kv_heads
    return 1 if work >= sms else max(1, min(32, -(-2 * sms // work)))


def gpu_estimate(chip_key: str, wl: Workload, cfg: KernelConfig) -> Estimate:
    chip = CHIPS[chip_key]
    K = wl.local_kv_heads
    head_bytes = wl.token_bytes // K                   # K + V of one head, one token
    if cfg.kernel == "gpu-paged":
        step_tokens, stages = cfg.page_size * cfg.pages_per_step, 3
        step_latency = chip.latency_s                  # next page's index fetched ahead
        dmas_per_step = 2 * cfg.pages_per_step
    else:
        step_tokens, stages = cfg.block_kv, cfg.num_stages
        step_latency = chip.latency_s + chip.index_latency_s
        dmas_per_step = 2
    stages = cfg.in_flight + 1 if cfg.in_flight else stages
    splits = 1
    if cfg.kernel in ("gpu-splitk", "gpu-paged"):     # gpu-paged: with the same split rule
        splits = cfg.splits or choose_splits(wl.rows, K, chip.sms)
    programs = wl.rows * K * splits
    tokens = math.ceil(wl.context / splits)
    steps = math.ceil(tokens / step_tokens)
    step_bytes = step_tokens * head_bytes
    per_sm = max(1, chip.smem_per_sm // (stages * step_bytes))
    slots = chip.sms * per_sm
    depth = stages - 1
    prog_bytes = tokens * head_bytes
    seconds, left = chip.call_s, programs
    while left > 0:
        a = min(left, slots)
        seconds += max(a * prog_bytes / chip.hbm_bytes_per_s,
                       step_latency * (1 + (steps - 1) / depth))
        left -= a
    moved = wl.rows * wl.context * wl.token_bytes
    if splits > 1:       # float32 partials (acc, m, l) written, then read by the combine
        partials = 2 * splits * wl.rows * (wl.q_heads // wl.tp) * (wl.head_dim + 2) * 4
        seconds += chip.call_s + partials / chip.hbm_bytes_per_s
        moved += partials
    lat = step_latency * (1 + (steps - 1) / depth)
    bound = "latency" if lat >= min(programs, slots) * prog_bytes / chip.hbm_bytes_per_s \
        else "bandwidth"
    inflight = min(programs, slots) * depth
    return Estimate(cfg.kernel, moved, programs * steps * dmas_per_step,
                    step_bytes // dmas_per_step, step_bytes, inflight,
                    inflight * step_bytes, seconds, bound, chip.hbm_bytes_per_s)


def estimate(chip: str, wl: Workload, cfg: KernelConfig) -> Estimate:
    if cfg.kernel in TPU_KERNELS:
        return tpu_estimate(chip, wl, cfg)
    return gpu_estimate(chip, wl, cfg)


def _fmt_bytes(n: float) -> str:
    for unit, div in (("MiB", MIB), ("KiB", KIB)):
        if n >= div:
            return f"{n / div:.4g} {unit}"
    return f"{n:.0f} B"


HEADER = ("| scenario | kernel | page | KV bytes/chip | DMAs | DMA size | transfer | in flight "
          "| bytes in flight | time | bound | share of peak |")


def row_text(scenario: str, page: int, e: Estimate) -> str:
    return (f"| {scenario} | {e.kernel} | {page} | {_fmt_bytes(e.bytes_moved)} | {e.dmas} | "
            f"{_fmt_bytes(e.dma_bytes)} | {_fmt_bytes(e.transfer_bytes)} | {e.in_flight} | "
            f"{_fmt_bytes(e.bytes_in_flight)} | {e.seconds * 1e6:.1f} us | {e.bound} | "
            f"{100 * e.share:.0f}% |")


# the design review's scenarios: Llama-3-8B (32 q heads, 8 kv heads, 128 dims, bf16)
REVIEW = [
    ("H200 TP=1, 64 x 2k", "h200", Workload(64, 2048), 16, GPU_KERNELS),
    ("H200 TP=1, 1 x 8k", "h200", Workload(1, 8192), 16, GPU_KERNELS),
    ("v5e TP=1 (8 kv heads/chip), 64 x 2k", "v5e", Workload(64, 2048), 32, TPU_KERNELS),
    ("v5e TP=8 (shipped), 64 x 2k", "v5e", Workload(64, 2048, tp=8), 32, TPU_KERNELS),
    ("v6e TP=4 (shipped), 64 x 2k", "v6e", Workload(64, 2048, tp=4), 32, TPU_KERNELS),
]


def review_table(page_sizes: Sequence[int] | None = None) -> list[str]:
    """Markdown lines: every review scenario x its chip's kernels (x page sizes)."""
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for name, chip, wl, page, kernels in REVIEW:
        for kernel in kernels:
            for bs in page_sizes or [page]:
                lines.append(row_text(name, bs, estimate(chip, wl, KernelConfig(kernel, bs))))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kernel_model", description=__doc__.split("\n\n")[0])
    p.add_argument("--review", action="store_true",
                   help="print the review's scenarios for every kernel (markdown)")
    p.add_argument("--page-sizes", type=int, nargs="*",
                   help="with --review: these page sizes instead of each config's")
    p.add_argument("--kernel", choices=KERNELS + ("all",), default="all")
    p.add_argument("--chip", choices=sorted(CHIPS), default="v5e")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(ITEMSIZE), default="bfloat16")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunk-bytes", type=int, help="tpu-pm chunk budget")
    p.add_argument("--chunk-pages", type=int, help="pages per chunk (TPU kernels)")
    p.add_argument("--in-flight", type=int, help="transfers kept in flight")
    p.add_argument("--splits", type=int, help="gpu-splitk splits")
    p.add_argument("--show-chips", action="store_true", help="print the chip constants")
    ns = p.parse_args(argv)
    if ns.show_chips:
        for key, chip in CHIPS.items():
            print(key, chip)
    if ns.review:
        print("\n".join(review_table(ns.page_sizes)))
        return 0
    wl = Workload(ns.rows, ns.context, ns.q_heads, ns.kv_heads, ns.head_dim, ns.dtype, ns.tp)
    gpu = ns.chip == "h200"
    kernels = [ns.kernel] if ns.kernel != "all" else (GPU_KERNELS if gpu else TPU_KERNELS)
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1))
    for kernel in kernels:
        if (kernel in GPU_KERNELS) != gpu:
            p.error(f"{kernel} does not run on {ns.chip}")
        cfg = KernelConfig(kernel, ns.page_size, ns.chunk_bytes, ns.chunk_pages, ns.in_flight,
                           ns.splits)
        scenario = f"{ns.chip} TP={ns.tp}, {ns.rows} x {ns.context}"
        print(row_text(scenario, ns.page_size, estimate(ns.chip, wl, cfg)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
