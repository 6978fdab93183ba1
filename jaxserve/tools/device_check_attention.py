"""Kernel section of jaxserve/tools/device_check.py: ragged paged attention vs jax's own
paged attention (jax.experimental.pallas.ops.gpu), against a float64 numpy reference.

Cases are built on the device (random caches of up to 2 GB would take minutes from host
numpy); the reference is computed on the host for a few rows of each case only, from
those rows' pages, so checking a 256 x 2k batch costs seconds.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .device_check_run import (ATOL, FULL_DECODE, FULL_HEADS, SMOKE_DECODE, SMOKE_HEADS,
                               Run, guarded, looped, time_loop)

CHECK_ROWS = 8          # rows of a case compared with the float64 reference
# --sweep: launch parameters of the tiled GPU kernel
SWEEP = ["tiled:block_kv=32", "tiled:block_kv=128", "tiled:num_warps=8",
         "tiled:block_kv=128,num_warps=8", "tiled:block_m=32", "tiled:block_m=128"]


@dataclass
class Case:
    q: Any                  # [T, N, H]
    k: Any                  # [K, NB, bs, H]
    v: Any
    cu: Any                 # [R+1] int32
    seq: Any                # [R] int32
    bt: Any                 # [R, P] int32
    q_lens: list[int]
    seq_lens: list[int]
    scale: float

    def kv_bytes(self) -> int:
        """Bytes of K and V every row must read once (its seq_len slots, all KV heads)."""
        K, _, _, H = self.k.shape
        return int(sum(self.seq_lens)) * K * H * 2 * self.k.dtype.itemsize

    def io_bytes(self) -> int:
        return self.kv_bytes() + 2 * self.q.size * self.q.dtype.itemsize


def make_case(key: Any, q_lens: list[int], ctx_lens: list[int], num_tokens: int,
              heads: dict, dtype: Any) -> Case:
    """Rows with q_lens new tokens after ctx_lens cached ones (all already in the cache),
    pages in random pool order; caches and queries random on the device."""
    import jax
    import jax.numpy as jnp
    K, G, H, bs = (heads[k] for k in ("num_kv_heads", "group", "head_dim", "block_size"))
    seq = [a + b for a, b in zip(q_lens, ctx_lens)]
    pages = [-(-s // bs) for s in seq]
    P, NB = max(pages), sum(pages) + 1                 # page 0: padding entries
    pool = np.random.default_rng(0).permutation(np.arange(1, NB)).astype(np.int32)
    bt = np.zeros((len(seq), P), np.int32)
    start = 0
    for r, n in enumerate(pages):
        bt[r, :n] = pool[start:start + n]
        start += n
    kq, kk, kv = jax.random.split(key, 3)
    shape = (K, NB, bs, H)
    return Case(q=jax.random.normal(kq, (num_tokens, K * G, H), dtype),
                k=jax.random.normal(kk, shape, dtype), v=jax.random.normal(kv, shape, dtype),
                cu=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
                seq=jnp.asarray(seq, jnp.int32), bt=jnp.asarray(bt),
                q_lens=list(q_lens), seq_lens=seq, scale=H ** -0.5)


def reference_rows(case: Case, rows: list[int]) -> dict[int, np.ndarray]:
    """float64 causal attention of the given rows: row -> [q_len, N, H]. Queries are
    scaled and rounded to their dtype first, as both kernels see them."""
    import jax.numpy as jnp
    K, _, bs, H = case.k.shape
    N = case.q.shape[1]
    G = N // K
    cu = np.asarray(case.cu)
    qs = np.asarray((case.q * case.scale).astype(case.q.dtype).astype(jnp.float32), np.float64)
    out = {}
    for r in rows:
        q_len, kv_len = case.q_lens[r], case.seq_lens[r]
        pages = case.bt[r, :-(-kv_len // bs)]
        k = np.asarray(case.k[:, pages].astype(jnp.float32), np.float64).reshape(K, -1, H)
        v = np.asarray(case.v[:, pages].astype(jnp.float32), np.float64).reshape(K, -1, H)
        k, v = k[:, :kv_len], v[:, :kv_len]
        qr = qs[cu[r]:cu[r] + q_len].reshape(q_len, K, G, H)
        s = np.einsum("qkgh,ksh->kgqs", qr, k)
        q_pos = kv_len - q_len + np.arange(q_len)
        s = np.where(np.arange(kv_len)[None, :] <= q_pos[:, None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[r] = np.einsum("kgqs,ksh->qkgh", p, v).reshape(q_len, N, H)
    return out


def compare(case: Case, out: Any, ref: dict[int, np.ndarray], dtype_name: str) -> dict:
    import jax.numpy as jnp
    cu = np.asarray(case.cu)
    got = np.asarray(out.astype(jnp.float32), np.float64)
    errs = np.concatenate([(got[cu[r]:cu[r] + case.q_lens[r]] - want).ravel()
                           for r, want in ref.items()])
    wants = np.concatenate([w.ravel() for w in ref.values()])
    max_err = float(np.max(np.abs(errs)))
    finite = bool(np.isfinite(got[:cu[-1]]).all())
    return {"max_err": max_err, "err_std": float(errs.std()), "ref_std": float(wants.std()),
            "rows_checked": len(ref), "finite": finite,
            "ok": finite and max_err <= ATOL[dtype_name]}


# ---- the implementations --------------------------------------------------------------------
def ours(case: Case, interpret: bool, variant: str = "engine", **tune: Any
         ) -> tuple[Callable, tuple]:
    """Our kernel: "engine" = the one the Pallas backend picks for this bucket (T = R =
    rows here: split-K on GPU decode buckets that underfill the SMs, RPA-v3 on TPU, else
    tiled); "tiled" / "splitk" force one (splitk: the rule's splits, at least 2)."""
    import jax
    from jaxserve.attention import pallas_backend
    from kernels_pallas.ragged_paged_attention import kernel_splitk
    from kernels_pallas.ragged_paged_attention.kernel import ragged_paged_attention
    T, R, K = case.q.shape[0], case.seq.shape[0], case.k.shape[0]
    if variant == "engine":
        platform = "cpu" if interpret else jax.default_backend()
        kernel = pallas_backend.kernel_for_bucket(platform, T, R, K)
    elif variant == "tiled":
        kernel = ragged_paged_attention
    else:
        splits = 2 if interpret else max(2, kernel_splitk.choose_num_splits(
            T, R, K, kernel_splitk.num_sms()))
        kernel = functools.partial(kernel_splitk.ragged_paged_attention_splitk,
                                   num_splits=splits)
    fn = functools.partial(kernel, scale=case.scale, interpret=interpret, **tune)
    return fn, (case.k, case.v, case.cu, case.seq, case.bt)


def kernel_label(fn: Any) -> str:
    """'ragged_paged_attention_splitk(num_splits=5)' for a (nested) partial."""
    kw: dict = {}
    while isinstance(fn, functools.partial):
        kw = {**fn.keywords, **kw}
        fn = fn.func
    shown = {k: v for k, v in kw.items() if k not in ("scale", "interpret")}
    return getattr(fn, "__name__", str(fn)) + (f"({shown})" if shown else "")


def jax_paged(case: Case, interpret: bool) -> tuple[Callable, tuple]:
    """jax's decode-only GPU kernel: q [B, N, H] unscaled by it (we pass it scaled), one
    query per sequence, pages split in k_splits partitions that must divide P."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    P = case.bt.shape[1]
    k_splits = max(d for d in range(1, 17) if P % d == 0)
    per_split = P // k_splits
    ppcb = max(d for d in range(1, 9) if per_split % d == 0)
    want = dict(k_splits=k_splits, pages_per_compute_block=ppcb, interpret=interpret)
    params = inspect.signature(paged_attention).parameters
    kw = {k: v for k, v in want.items() if k in params}

    def fn(q, k, v, bt, seq):
        return paged_attention(q * case.scale, k, v, bt, seq, **kw)
    return fn, (case.k, case.v, case.bt, case.seq)


def measure(run: Run, case: Case, impl: str, ref: dict, dtype_name: str) -> dict:
    interpret = run.smoke
    if impl == "jax":
        fn, rest = jax_paged(case, interpret)
    else:                                   # "ours", "tiled", "splitk", "tiled:k=v,k=v"
        variant, _, tune = impl.partition(":")
        kw = {k: int(v) for k, v in (kv.split("=") for kv in tune.split(",") if kv)}
        fn, rest = ours(case, interpret, "engine" if variant == "ours" else variant, **kw)
    loop = looped(fn)
    row = compare(case, loop(case.q, 1, *rest), ref, dtype_name)
    secs = time_loop(loop, case.q, rest, run.iters, reps=1 if run.smoke else 3)
    nbytes = case.io_bytes()
    row.update(us=secs * 1e6, gbps=nbytes / secs / 1e9, mbu=run.mbu(nbytes, secs),
               bytes=nbytes)
    row["kernel"] = "jax paged_attention" if impl == "jax" else kernel_label(fn)
    return row


def check_rows(q_lens: list[int]) -> list[int]:
    """Every multi-token row (prefill chunks) plus up to CHECK_ROWS rows spread evenly."""
    n = len(q_lens)
    spread = sorted({round(i * (n - 1) / max(CHECK_ROWS - 1, 1)) for i in range(CHECK_ROWS)})
    return sorted(set(spread[:n]) | {r for r, q in enumerate(q_lens) if q > 1})


def kernel_section(run: Run) -> None:
    import jax
    heads = SMOKE_HEADS if run.smoke else FULL_HEADS
    dtype_name = str(np.dtype(run.dtype).name) if run.dtype is not None else "bfloat16"
    workloads = [(name, [1] * b, [c - 1] * b, b) for name, b, c in
                 (SMOKE_DECODE if run.smoke else FULL_DECODE)]
    mixed = (([9, 5, 1, 1], [0, 7, 20, 3], 24) if run.smoke else
             ([512] * 4 + [1] * 60, [0, 512, 1024, 1536] + [2047] * 60, 2112))
    workloads.append(("mixed", *mixed))
    gpu_like = jax.default_backend() in ("gpu", "cuda", "rocm") or run.smoke
    for i, (name, q_lens, ctx, tokens) in enumerate(workloads):
        box: dict[str, Any] = {}

        def build(name=name, q_lens=q_lens, ctx=ctx, tokens=tokens, i=i) -> dict:
            case = make_case(jax.random.PRNGKey(i), q_lens, ctx, tokens, heads, run.dtype)
            box["case"] = case
            box["ref"] = reference_rows(case, check_rows(q_lens))
            return {"ok": True, "rows": len(q_lens), "tokens": tokens,
                    "kv_tokens": sum(case.seq_lens)}
        guarded(run, "kernel_setup", name, 15 + run.reserve_s, build)
        if "case" not in box:
            continue
        impls = ["ours"]
        if name != "mixed":
            picked = kernel_label(ours(box["case"], run.smoke)[0])
            # the variant the engine did not pick, for comparison (both in interpret mode)
            impls += (["tiled"] if "splitk" in picked else ["splitk"]
                      if run.smoke or gpu_like else [])
            impls += ["jax"] if gpu_like else []
        if run.sweep and name in ("64x2k", "mixed"):  # the old script's tuning sweep
            impls += SWEEP
        for impl in impls:
            guarded(run, "kernels", name, 10 + run.reserve_s,
                    lambda impl=impl: measure(run, box["case"], impl, box["ref"], dtype_name),
                    impl=impl)
        box.clear()                                   # free the caches before the next case
