"""A comparison against ref.py that a kernel which silently skips one KV page MUST fail.

An elementwise allclose with a bf16-sized tolerance does not catch a dropped page on
long contexts: an attention output over S random keys has magnitude ~ 1/sqrt(S), so
losing one page of bs keys moves it by ~ bs/S, under an absolute tolerance of 3e-2
once S is a few thousand. Two defences, used together:

* `relative_error`: per batch row, the largest |out - ref| over the row's tokens,
  heads and dims divided by the RMS of the row's reference output (its own scale),
  so a row with small outputs is judged on its own scale. Dropping one page of bs
  keys out of S gives a ratio near 3 * bs / sqrt(S) (1.06 at bs 16, S 2048), while
  correct bf16 arithmetic stays near 1e-2.
* `dominant_page_case`: a case rewritten so that one page of each chosen row holds
  the keys every query of the row attends to (queries all along one direction u,
  that page's keys along u, strongly), so the row's output is essentially that
  page's values; a kernel that skips the page is wrong by O(1) at any length.

`block_drop_check(out, want, cu_q_lens, tol)` runs the first and says which rows fail.
numpy only; jax arrays are accepted.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

# per-row relative error bounds for correct kernels, by compute dtype name
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}


def relative_error(out: Any, want: Any, cu_q_lens: Any) -> np.ndarray:
    """[R] per row: max |out - want| / RMS(want) over the row's tokens (0 for empty
    rows). out, want [T, N, H]; cu_q_lens [R+1]."""
    o = np.asarray(out, np.float64)
    ref = np.asarray(want, np.float64)
    cu = np.asarray(cu_q_lens)
    errs = np.zeros(len(cu) - 1)
    for r in range(len(cu) - 1):
        a, b = int(cu[r]), int(cu[r + 1])
        if b <= a:
            continue
        scale = np.sqrt(np.mean(ref[a:b] ** 2)) + 1e-12
        errs[r] = np.max(np.abs(o[a:b] - ref[a:b])) / scale
    return errs


def block_drop_check(out: Any, want: Any, cu_q_lens: Any, tol: float | None = None,
                     dtype: str = "bfloat16") -> tuple[bool, np.ndarray]:
    """(every row within tol, per-row relative errors). tol defaults to TOLERANCE[dtype];
    non-finite outputs fail."""
    tol = TOLERANCE[dtype] if tol is None else tol
    errs = relative_error(out, want, cu_q_lens)
    ok = bool(np.all(np.isfinite(errs)) and np.all(errs <= tol))
    return ok, errs


def dominant_page_case(case: Any, rows_pages: Sequence[tuple[int, int]], *,
                       strength: float = 4.0, seed: int = 0) -> Any:
    """A copy of a cases.Case in which, for each (row, page index), every query of the
    row points along one random unit vector u (times sqrt(H)) and the keys of that
    page are strength * sqrt(H) * u, every other key staying random. The page must be
    visible to every query of the row (e.g. a context page inside any window).
    Head-major caches [K, NB, bs, H]; q [T, N, H]."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    q = np.asarray(case.q, np.float32).copy()
    k = np.asarray(case.k_cache.astype(jnp.float32), np.float32).copy()
    H = q.shape[-1]
    for row, page in rows_pages:
        u = rng.standard_normal(H).astype(np.float32)
        u /= np.linalg.norm(u)
        a, b = int(case.cu_q_lens[row]), int(case.cu_q_lens[row + 1])
        q[a:b] = np.sqrt(H) * u
        blk = int(case.block_tables[row, page])
        k[:, blk] = strength * np.sqrt(H) * u
    return dataclasses.replace(case, q=jnp.asarray(q, case.q.dtype),
                               k_cache=jnp.asarray(k, case.k_cache.dtype))
