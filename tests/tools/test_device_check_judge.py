"""The kernel check's judge (jaxserve/tools/device_check_attention.py) on its own: the
float64 reference passes, and a kernel that loses one KV page of one row (the reference
computed without that page) fails, with the page named; the device check imports none of
the server's or the structured-output stack's packages (the accelerator image lacks them)."""
from __future__ import annotations

import numpy as np
import pytest
from server_free import run_server_free

@pytest.fixture(scope="module")
def case():
    import jax
    import jax.numpy as jnp
    from jaxserve.tools.device_check_attention import make_case
    from jaxserve.tools.device_check_run import SMOKE_HEADS
    # 3 decode rows of 64 / 33 / 9 tokens (8, 5 and 2 pages) and one prefill chunk of 5
    return make_case(jax.random.PRNGKey(3), [1, 1, 1, 5], [63, 32, 8, 20], 8, SMOKE_HEADS,
                     jnp.float32)


def _output(case, refs) -> np.ndarray:
    """A kernel's [T, N, H] output made of reference rows."""
    cu = np.asarray(case.cu)
    out = np.zeros(case.q.shape, np.float32)
    for r, ref in refs.items():
        out[cu[r]:cu[r + 1]] = ref.out
    return out


def test_the_reference_passes_its_own_check(case):
    from jaxserve.tools.device_check_attention import judge, reference_rows
    refs = reference_rows(case, [0, 1, 2, 3])
    row = judge(case, _output(case, refs), refs)
    assert row["ok"] and row["rel_err"] < 1e-6 and row["block_drop"] == [], row
    # the page-less outputs: finite and different from the full one (a row of 2+ pages)
    assert np.isfinite(refs[0].drops).all() and refs[0].drops.shape[0] == 8
    assert np.abs(refs[0].drops - refs[0].out[-1]).max() > 1e-3


@pytest.mark.parametrize("row,page", [(0, 5), (0, 0), (1, 4), (3, 2)])
def test_a_kernel_that_drops_one_page_of_one_row_fails(case, row, page):
    from jaxserve.tools.device_check_attention import judge, reference_rows
    refs = reference_rows(case, [0, 1, 2, 3])
    broken = reference_rows(case, [0, 1, 2, 3], drop=(row, page))
    verdict = judge(case, _output(case, broken), refs)
    assert not verdict["ok"], verdict
    K = case.k.shape[0]
    assert verdict["block_drop"] == [f"{row}:{kh}:{page}" for kh in range(K)], verdict


def test_a_small_error_everywhere_is_within_tolerance_and_no_drop(case):
    from jaxserve.tools.device_check_attention import judge, reference_rows
    refs = reference_rows(case, [0, 1, 2, 3])
    out = _output(case, refs)
    noisy = out + np.random.default_rng(0).normal(0, 1e-3 * out.std(), out.shape)
    verdict = judge(case, noisy.astype(np.float32), refs)
    assert verdict["ok"] and verdict["block_drop"] == [], verdict
    assert not judge(case, (out * 1.05).astype(np.float32), refs)["ok"]


IMPORTS = """
from jaxserve.tools import device_check, device_check_attention, device_check_engine
import jaxserve.core.engine_core, jaxserve.attention.pallas_backend
print("imported")
"""


def test_device_check_modules_import_without_server_packages():
    proc = run_server_free(IMPORTS, timeout=120)
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr[-3000:]
    assert "TRIED []" in proc.stdout, proc.stdout


def test_full_workloads_run_in_order_and_only_1x8k_shares_8x8k_compile(tmp_path):
    import jax.numpy as jnp
    from jaxserve.tools.device_check_attention import workloads
    from jaxserve.tools.device_check_run import Run
    run = Run(smoke=False, out=tmp_path, budget_s=1, iters=1, peak_bw=None, dtype=jnp.bfloat16)
    got = {name: (len(q), tokens, group) for name, q, _, tokens, group in workloads(run)}
    assert list(got) == ["64x2k", "8x8k", "1x8k", "256x2k", "mixed"]
    assert got["1x8k"] == (1, 8, (8, 8192)) and got["8x8k"] == (8, 8, (8, 8192))
    assert got["64x2k"][2] == (64, 2048) and got["256x2k"][2] == (256, 2048)
