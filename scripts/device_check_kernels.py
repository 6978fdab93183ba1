"""Device check for the ragged paged attention kernel: correctness and timing.

On a lent GPU (or TPU), at Llama-3-8B attention shapes (32 q heads, 8 kv heads,
head_dim 128, bf16, block size 16):
  * decode: 64 sequences, 2k context, one token each;
  * mixed: 4 prefill chunks of 512 (contexts 0..1.5k) + 60 decodes at 2k.
It checks the native kernel and the XLA reference backend against ref.py, times
both (and a small sweep of kernel block sizes), and writes results.md and
results.json to --out (default $OUT, else ./device_check_out).

    python scripts/device_check_kernels.py            # accelerator
    python scripts/device_check_kernels.py --smoke    # CPU, tiny shapes, interpret mode
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from jaxserve.attention import reference  # noqa: E402
from kernels_pallas.ragged_paged_attention.cases import make_case  # noqa: E402
from kernels_pallas.ragged_paged_attention.kernel import ragged_paged_attention  # noqa: E402
from kernels_pallas.ragged_paged_attention.ref import ragged_paged_attention_ref  # noqa: E402

FULL = dict(num_kv_heads=8, group=4, head_dim=128, block_size=16, dtype=jnp.bfloat16)
SMOKE = dict(num_kv_heads=2, group=2, head_dim=64, block_size=8, dtype=jnp.float32)
ATOL = {jnp.bfloat16: 3e-2, jnp.float32: 2e-5}
reference_jit = jax.jit(reference.paged_attention, static_argnames=("scale",))


def workloads(smoke: bool) -> dict[str, tuple[list[int], list[int], int]]:
    """name -> (q_lens, ctx_lens, padded num_tokens)."""
    if smoke:
        # one padded shape for both, so the smoke run compiles each function once
        return {"decode": ([1] * 4, [20] * 4, 24),
                "mixed": ([9, 5, 1, 1], [0, 7, 20, 3], 24)}
    return {"decode": ([1] * 64, [2047] * 64, 64),
            "mixed": ([512] * 4 + [1] * 60, [0, 512, 1024, 1536] + [2047] * 60, 2112)}


def sweep(name: str, smoke: bool) -> list[dict]:
    if smoke:
        return [{}]
    if name == "decode":
        return [{}, {"block_kv": 32}, {"block_kv": 128}, {"num_warps": 8},
                {"block_kv": 128, "num_warps": 8}]
    return [{}, {"block_m": 32}, {"block_m": 128}, {"block_kv": 128},
            {"block_m": 128, "block_kv": 128, "num_warps": 8}]


def bench(fn, *args, iters: int) -> float:
    """Median wall time in ms of a jitted call (after one warm-up/compile call)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def max_err(a, b, n: int) -> float:
    return float(jnp.max(jnp.abs(a[:n].astype(jnp.float32) - b[:n].astype(jnp.float32))))


def run_workload(name, q_lens, ctx, num_tokens, shapes, *, smoke, iters) -> list[dict]:
    rng = np.random.default_rng(0)
    bs = shapes["block_size"]
    pages = -(-max(q + c for q, c in zip(q_lens, ctx)) // bs)
    pages = -(-pages // 8) * 8
    case = make_case(rng, q_lens, ctx, num_tokens=num_tokens, num_rows=len(q_lens),
                     pages=pages, num_blocks=len(q_lens) * pages + 8, **shapes)
    scale = shapes["head_dim"] ** -0.5
    n = case.num_real_tokens
    want = ragged_paged_attention_ref(case.q, case.k_cache, case.v_cache, case.cu_q_lens,
                                      case.seq_lens, case.block_tables, scale=scale)
    ref_fn = functools.partial(reference_jit, scale=scale)
    ref_args = (case.q, case.k_new, case.v_new, case.k_cache, case.v_cache, case.metadata())
    ref_ms = bench(ref_fn, *ref_args, iters=iters)
    ref_err = max_err(ref_fn(*ref_args), want, n)
    rows = []
    for tune in sweep(name, smoke):
        row = {"workload": name, "tokens": num_tokens, "rows": len(q_lens),
               "kv_tokens": int(case.seq_lens.sum()), "tune": tune, "xla_ref_ms": ref_ms,
               "xla_ref_max_err": ref_err}
        try:
            fn = functools.partial(ragged_paged_attention, scale=scale, interpret=smoke,
                                   **tune)
            out = fn(*case.kernel_args())
            row["kernel_max_err"] = max_err(out, want, n)
            row["finite"] = bool(jnp.isfinite(out.astype(jnp.float32)).all())
            row["kernel_ms"] = bench(fn, *case.kernel_args(), iters=iters)
            row["speedup"] = ref_ms / row["kernel_ms"]
            row["ok"] = (row["finite"] and row["kernel_max_err"] <= ATOL[shapes["dtype"]]
                         and ref_err <= ATOL[shapes["dtype"]])
        except Exception as e:  # keep the other configs' results
            row["ok"] = False
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            traceback.print_exc()
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def write_report(out: pathlib.Path, meta: dict, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# ragged paged attention device check ({meta['device']}, jax {meta['jax']})",
             "", "| workload | tune | kernel ms | XLA ref ms | speedup | kernel err | "
             "ref err | ok |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['tune'] or 'default'} | "
                     f"{r.get('kernel_ms', float('nan')):.3f} | {r['xla_ref_ms']:.3f} | "
                     f"{r.get('speedup', float('nan')):.2f} | "
                     f"{r.get('kernel_max_err', float('nan')):.2e} | "
                     f"{r['xla_ref_max_err']:.2e} | {r['ok']} |")
    errors = [f"- {r['workload']} {r['tune']}: {r['error']}" for r in rows if "error" in r]
    (out / "results.md").write_text("\n".join(lines + [""] + errors) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    p.add_argument("--out", default=os.environ.get("OUT", "device_check_out"))
    p.add_argument("--iters", type=int, default=None)
    args = p.parse_args(argv)
    shapes = SMOKE if args.smoke else FULL
    iters = args.iters or (2 if args.smoke else 20)
    meta = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
            "jax": jax.__version__, "smoke": args.smoke,
            "shapes": {k: str(v) for k, v in shapes.items()}}
    print(json.dumps(meta), flush=True)
    rows: list[dict] = []
    for name, (q_lens, ctx, num_tokens) in workloads(args.smoke).items():
        rows += run_workload(name, q_lens, ctx, num_tokens, shapes, smoke=args.smoke,
                             iters=iters)
        write_report(pathlib.Path(args.out), meta, rows)
    ok = all(r["ok"] for r in rows)
    print(f"{'PASS' if ok else 'FAIL'}: wrote {args.out}/results.md", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
