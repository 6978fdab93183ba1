"""Kernel section of jaxserve/tools/device_check.py: attention kernels side by side (the
engine's pick, the other variant, jax's own paged attention, any kernel named on the
command line), each judged against a float64 numpy reference and timed.

Cases are built on the device (random caches of up to 2 GB would take minutes from host
numpy); the reference is computed on the host for a few rows of each case only, from
those rows' pages, so checking a 256 x 2k batch costs seconds.

Correctness (judge): the RMS error over the checked rows relative to the reference's own
standard deviation (<= REL_TOL; a max-abs bound would have to be loose enough for bf16
rounding of outputs near the tails, and then a kernel that skips a whole KV page at 8k
context, which moves the output by ~1/512 of its mass, passes), plus an exact
missing-page detector: for each checked row's last query the reference is also computed
with each one of its KV pages left out, and an output closer to one of those than to the
full reference names the page (row, KV head, page).

Workloads of one shape group share their compiled timing loops: 1x8k runs padded to
8x8k's rows, pages and pool (rows of length 0), so it costs no compile.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .device_check_run import (FULL_DECODE, FULL_HEADS, REL_TOL, SHARES_COMPILE,
                               SMOKE_DECODE, SMOKE_HEADS, Run, guarded, looped, time_loop)

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
        return self.kv_bytes() + 2 * int(sum(self.q_lens)) * int(np.prod(self.q.shape[1:])) \
            * self.q.dtype.itemsize


def make_case(key: Any, q_lens: list[int], ctx_lens: list[int], num_tokens: int,
              heads: dict, dtype: Any, rows: int | None = None, pages: int | None = None,
              pool: int | None = None) -> Case:
    """Rows with q_lens new tokens after ctx_lens cached ones (all already in the cache),
    pages in random pool order; caches and queries random on the device. rows, pages,
    pool: pad to that many rows (length 0), block-table width and pool pages (the shapes
    of another case, whose compiled programs this one then reuses)."""
    import jax
    import jax.numpy as jnp
    K, G, H, bs = (heads[k] for k in ("num_kv_heads", "group", "head_dim", "block_size"))
    pad = (rows or len(q_lens)) - len(q_lens)
    q_lens, ctx_lens = list(q_lens) + [0] * pad, list(ctx_lens) + [0] * pad
    seq = [a + b for a, b in zip(q_lens, ctx_lens)]
    need = [-(-s // bs) for s in seq]
    P, NB = max(pages or 0, max(need)), max(pool or 0, sum(need) + 1)   # page 0: padding
    order = np.random.default_rng(0).permutation(np.arange(1, NB)).astype(np.int32)
    bt = np.zeros((len(seq), P), np.int32)
    start = 0
    for r, n in enumerate(need):
        bt[r, :n] = order[start:start + n]
        start += n
    kq, kk, kv = jax.random.split(key, 3)
    shape = (K, NB, bs, H)
    return Case(q=jax.random.normal(kq, (num_tokens, K * G, H), dtype),
                k=jax.random.normal(kk, shape, dtype), v=jax.random.normal(kv, shape, dtype),
                cu=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
                seq=jnp.asarray(seq, jnp.int32), bt=jnp.asarray(bt),
                q_lens=q_lens, seq_lens=seq, scale=H ** -0.5)


# ---- the reference and the judge ------------------------------------------------------------
@dataclass
class RowRef:
    out: np.ndarray         # [q_len, N, H] float64 attention of the row's queries
    drops: np.ndarray       # [pages, N, H] its last query's output with page j left out


def reference_rows(case: Case, rows: list[int], drop: tuple[int, int] | None = None
                   ) -> dict[int, RowRef]:
    """float64 causal attention of the given rows (queries scaled and rounded to their
    dtype first, as the kernels see them). drop=(row, page): that row's page (index in
    its block table) is left out, i.e. a kernel that loses it (for tests)."""
    import jax.numpy as jnp
    K, _, bs, H = case.k.shape
    N = case.q.shape[1]
    G = N // K
    cu = np.asarray(case.cu)
    qs = np.asarray((case.q * case.scale).astype(case.q.dtype).astype(jnp.float32), np.float64)
    out = {}
    for r in rows:
        q_len, kv_len = case.q_lens[r], case.seq_lens[r]
        n_pages = -(-kv_len // bs)
        pages = np.asarray(case.bt[r, :n_pages])
        k = np.asarray(case.k[:, pages].astype(jnp.float32), np.float64).reshape(K, -1, H)
        v = np.asarray(case.v[:, pages].astype(jnp.float32), np.float64).reshape(K, -1, H)
        k, v = k[:, :kv_len], v[:, :kv_len]
        qr = qs[cu[r]:cu[r] + q_len].reshape(q_len, K, G, H)
        s = np.einsum("qkgh,ksh->kgqs", qr, k)
        q_pos = kv_len - q_len + np.arange(q_len)
        keep = np.arange(kv_len)[None, :] <= q_pos[:, None]
        if drop is not None and drop[0] == r:
            keep = keep & (np.arange(kv_len) // bs != drop[1])[None, :]
        s = np.where(keep, s, -np.inf)
        e = np.exp(s - s.max(-1, keepdims=True))                  # [K, G, q, S]
        o = np.einsum("kgqs,ksh->qkgh", e / e.sum(-1, keepdims=True), v).reshape(q_len, N, H)
        # the last query without each page: (numerator - page's) / (mass - page's)
        el = np.pad(e[:, :, -1], ((0, 0), (0, 0), (0, n_pages * bs - kv_len)))
        el = el.reshape(K, G, n_pages, bs)                         # [K, G, P, bs]
        vp = np.pad(v, ((0, 0), (0, n_pages * bs - kv_len), (0, 0))).reshape(K, n_pages, bs, H)
        num_p = np.einsum("kgpb,kpbh->kgph", el, vp)               # [K, G, P, H]
        mass_p = el.sum(-1)                                        # [K, G, P]
        num, mass = num_p.sum(2, keepdims=True), mass_p.sum(2, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            d = (num - num_p) / (mass - mass_p)[..., None]         # [K, G, P, H]
        out[r] = RowRef(o, np.transpose(d, (2, 0, 1, 3)).reshape(n_pages, N, H))
    return out


def judge(case: Case, got: Any, refs: dict[int, RowRef], rel_tol: float = REL_TOL) -> dict:
    """Compare a kernel's output [T, N, H] with the reference rows: relative RMS error,
    max error, and the pages a row's last query looks like it lost (block_drop: a list
    of "row:kv_head:page"; any entry fails the check)."""
    cu = np.asarray(case.cu)
    got = np.asarray(np.asarray(got, np.float32), np.float64)
    errs, wants, drops = [], [], []
    K = case.k.shape[0]
    for r, ref in refs.items():
        mine = got[cu[r]:cu[r] + case.q_lens[r]]
        errs.append((mine - ref.out).ravel())
        wants.append(ref.out.ravel())
        last = mine[-1].reshape(K, -1)                             # [K, G*H]
        full = ref.out[-1].reshape(K, -1)
        alt = ref.drops.reshape(ref.drops.shape[0], K, -1)         # [P, K, G*H]
        e_full = np.linalg.norm(last - full, axis=-1)              # [K]
        e_alt = np.linalg.norm(np.nan_to_num(alt - last[None], nan=np.inf), axis=-1)
        moved = np.linalg.norm(np.nan_to_num(alt - full[None], nan=0.0), axis=-1)
        for kh in range(K):
            j = int(np.argmin(e_alt[:, kh]))
            # closer to the page-less output than to the full one, by a clear margin
            if moved[j, kh] > 0 and e_alt[j, kh] < 0.5 * e_full[kh]:
                drops.append(f"{r}:{kh}:{j}")
    err = np.concatenate(errs) if errs else np.zeros(1)
    want = np.concatenate(wants) if wants else np.ones(1)
    ref_std = float(want.std())
    rel = float(np.sqrt(np.mean(err ** 2)) / max(ref_std, 1e-30))
    finite = bool(np.isfinite(got[:cu[-1]]).all())
    return {"rel_err": rel, "max_err": float(np.max(np.abs(err))), "ref_std": ref_std,
            "rows_checked": len(refs), "finite": finite, "block_drop": drops[:8],
            "ok": finite and rel <= rel_tol and not drops}


# ---- the implementations (data: add a kernel with --kernel NAME=module:function) ----------
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


def named(spec: str) -> Callable[[Case, bool], tuple[Callable, tuple]]:
    """A kernel given as "module:function", called like ragged_paged_attention
    (q, k_cache, v_cache, cu_q_lens, seq_lens, block_tables, *, scale, interpret)."""
    module, _, attr = spec.partition(":")

    def build(case: Case, interpret: bool) -> tuple[Callable, tuple]:
        kernel = getattr(importlib.import_module(module), attr)
        return (functools.partial(kernel, scale=case.scale, interpret=interpret),
                (case.k, case.v, case.cu, case.seq, case.bt))
    return build


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
    scale = case.scale

    def fn(q, k, v, bt, seq):
        return paged_attention(q * scale, k, v, bt, seq, **kw)
    fn.__name__ = "jax paged_attention"
    return fn, (case.k, case.v, case.bt, case.seq)


@dataclass(frozen=True)
class KernelImpl:
    name: str
    build: Callable[..., tuple[Callable, tuple]]     # (case, interpret) -> (fn, rest)
    decode_only: bool = False       # one query per row (skipped for the mixed workload)
    gpu_only: bool = False          # (the smoke run interprets it on the CPU)
    tune: dict = field(default_factory=dict)


def registry(run: Run) -> dict[str, KernelImpl]:
    """Every implementation the section knows, by name."""
    impls = {
        "ours": KernelImpl("ours", functools.partial(ours, variant="engine")),
        "tiled": KernelImpl("tiled", functools.partial(ours, variant="tiled")),
        "splitk": KernelImpl("splitk", functools.partial(ours, variant="splitk")),
        "jax": KernelImpl("jax", jax_paged, decode_only=True, gpu_only=True),
    }
    for spec in SWEEP:
        variant, _, tune = spec.partition(":")
        kw = {k: int(v) for k, v in (kv.split("=") for kv in tune.split(",") if kv)}
        impls[spec] = KernelImpl(spec, functools.partial(ours, variant=variant, **kw))
    for name, spec in run.extra_kernels.items():
        impls[name] = KernelImpl(name, named(spec))
    return impls


def chosen(run: Run, name: str, picked: str, gpu_like: bool) -> list[str]:
    """The implementations for one workload: --kernels, else ours, the variant the engine
    did not pick, jax's (GPU), the --kernel ones; --sweep adds the tiled variants."""
    if run.kernels:
        names = list(run.kernels)
    else:
        names = ["ours"]
        if name != "mixed" and (run.smoke or gpu_like):
            names.append("tiled" if "splitk" in picked else "splitk")
        names += ["jax"] if gpu_like and name != "mixed" else []
        names += list(run.extra_kernels)
    if run.sweep and name in ("64x2k", "mixed"):
        names += SWEEP
    return names


def measure(run: Run, case: Case, impl: KernelImpl, refs: dict, group: Any) -> dict:
    """Compile (bounded by the deadline; a group's loop is compiled once), check, time."""
    import jax
    fn, rest = impl.build(case, run.smoke)
    key = (impl.name, group)
    compiled = key not in run.loops
    if compiled:
        loop = looped(fn)
        run.bounded(f"{impl.name} compile",
                    lambda: loop.lower(case.q, 1, *rest).compile())
        run.loops[key] = loop
    loop = run.loops[key]
    got = run.bounded(f"{impl.name} first call",
                      lambda: jax.device_get(jax.block_until_ready(loop(case.q, 1, *rest))))
    row = judge(case, got, refs)
    secs = time_loop(loop, case.q, rest, run.iters, reps=1 if run.smoke else 3, run=run)
    nbytes = case.io_bytes()
    row.update(us=secs * 1e6, gbps=nbytes / secs / 1e9, mbu=run.mbu(nbytes, secs),
               bytes=nbytes, kernel=kernel_label(fn), compiled=compiled)
    return row


def check_rows(q_lens: list[int]) -> list[int]:
    """Every multi-token row (prefill chunks) plus up to CHECK_ROWS rows spread evenly
    (rows of length 0, padding, are never checked)."""
    live = [r for r, q in enumerate(q_lens) if q > 0]
    n = len(live)
    spread = sorted({live[round(i * (n - 1) / max(CHECK_ROWS - 1, 1))]
                     for i in range(min(CHECK_ROWS, n))})
    return sorted(set(spread) | {r for r in live if q_lens[r] > 1})


def workloads(run: Run) -> list[tuple[str, list[int], list[int], int, Any]]:
    """(name, q_lens, ctx_lens, tokens, shape group) in run order. One group: one set
    of shapes, so one compile per implementation (SHARES_COMPILE: a workload padded to
    an earlier one's rows, pages and pool)."""
    decode = SMOKE_DECODE if run.smoke else FULL_DECODE
    shape = {name: (b, c) for name, b, c in decode}
    out = []
    for name, b, c in decode:
        group = shape[SHARES_COMPILE.get(name, name)]      # (rows, context) padded to
        out.append((name, [1] * b, [c - 1] * b, group[0], group))
    mixed = (([9, 5, 1, 1], [0, 7, 20, 3], 24) if run.smoke else
             ([512] * 4 + [1] * 60, [0, 512, 1024, 1536] + [2047] * 60, 2112))
    out.append(("mixed", *mixed, "mixed"))
    return out


def kernel_section(run: Run) -> None:
    import jax
    heads = SMOKE_HEADS if run.smoke else FULL_HEADS
    bs = heads["block_size"]
    gpu_like = jax.default_backend() in ("gpu", "cuda", "rocm") or run.smoke
    impls = registry(run)
    for i, (name, q_lens, ctx, tokens, group) in enumerate(workloads(run)):
        box: dict[str, Any] = {}

        def build(name=name, q_lens=q_lens, ctx=ctx, tokens=tokens, group=group, i=i) -> dict:
            shape = {}
            if group != "mixed":            # padded to the group's shapes
                rows, c = group
                pages = -(-c // bs)
                shape = dict(rows=rows, pages=pages, pool=rows * pages + 1)
            case = run.bounded("case", lambda: make_case(
                jax.random.PRNGKey(i), q_lens, ctx, tokens, heads, run.dtype, **shape))
            box["case"] = case
            box["refs"] = run.bounded("reference", lambda: reference_rows(
                case, check_rows(case.q_lens)))
            return {"ok": True, "rows": len(q_lens), "tokens": tokens,
                    "kv_tokens": sum(case.seq_lens)}
        guarded(run, "kernel_setup", name, 15 + run.reserve_s, build)
        if "case" not in box:
            continue
        picked = kernel_label(ours(box["case"], run.smoke)[0])
        first_us = None
        for impl_name in chosen(run, name, picked, gpu_like):
            impl = impls.get(impl_name)
            if impl is None or (impl.decode_only and name == "mixed") or \
                    (impl.gpu_only and not gpu_like):
                continue

            def one(impl=impl) -> dict:
                row = measure(run, box["case"], impl, box["refs"], group)
                row["vs_first"] = first_us / row["us"] if first_us else 1.0
                return row
            guarded(run, "kernels", name, 10 + run.reserve_s, one, impl=impl_name)
            last = run.results["kernels"][-1]
            if first_us is None and last.get("us"):
                first_us = last["us"]
        box.clear()                                   # free the caches before the next case
