"""The C++ CPU ragged paged attention kernel (kernels_cpu) vs the float64 ref.py and the
jnp reference backend, over ragged layouts, head shapes, block sizes, windows, soft-cap."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.attention import reference
from kernels_cpu.ragged_paged_attention.kernel import ragged_paged_attention
from jaxserve.attention.metadata import AttentionMetadata
from kernels_pallas.ragged_paged_attention.cases import make_case
from kernels_pallas.ragged_paged_attention.ref import ragged_paged_attention_ref

T_PAD, R_PAD, MAX_SEQ = 48, 6, 70
LAYOUTS = [
    # decode, a chunk after context splitting a block, an empty row, first-chunk prefills
    ([1, 7, 0, 9, 1], [13, 5, 4, 0, 0]),
    # all decodes, contexts on and around block boundaries
    ([1, 1, 1, 1, 1, 1], [0, 7, 8, 15, 16, 33]),
    # one long chunk (several 16-token query tiles) filling the token budget
    ([48], [20]),
    # two multi-tile chunks and decodes
    ([17, 1, 20, 1], [0, 50, 31, 69]),
]


def random_layout(rng: np.random.Generator) -> tuple[list[int], list[int]]:
    rows = int(rng.integers(1, R_PAD + 1))
    cuts = np.sort(rng.integers(0, T_PAD + 1, size=rows))
    q_lens = np.diff(np.concatenate([[0], cuts])).tolist()
    return q_lens, [int(rng.integers(0, MAX_SEQ - q + 1)) for q in q_lens]


CONFIGS = [
    # kv_heads, group, head_dim, block_size, dtype, sliding_window, soft_cap
    pytest.param(3, 3, 64, 16, jnp.float32, None, None, id="smollm2-gqa3-h64-bs16"),
    pytest.param(4, 1, 64, 8, jnp.float32, None, None, id="mha-h64-bs8-generic"),
    pytest.param(1, 8, 128, 16, jnp.float32, None, None, id="mqa8-h128-bs16"),
    pytest.param(2, 4, 64, 32, jnp.float32, None, None, id="gqa4-h64-bs32"),
    pytest.param(2, 2, 80, 16, jnp.float32, None, None, id="odd-h80-generic"),
    pytest.param(2, 2, 64, 16, jnp.float32, 5, None, id="window5"),
    pytest.param(2, 2, 128, 16, jnp.float32, 23, 5.0, id="window23-softcap"),
    pytest.param(2, 4, 64, 16, jnp.bfloat16, None, None, id="bf16-cast"),
]


@pytest.mark.parametrize("kv_heads,group,head_dim,block_size,dtype,window,cap", CONFIGS)
def test_cpu_kernel_matches_refs(kv_heads, group, head_dim, block_size, dtype, window, cap):
    scale = head_dim ** -0.5
    fn = jax.jit(functools.partial(ragged_paged_attention, scale=scale,
                                   sliding_window=window, soft_cap=cap))
    ref_jit = jax.jit(functools.partial(reference.paged_attention, scale=scale,
                                        sliding_window=window, soft_cap=cap))
    rng = np.random.default_rng(hash((kv_heads, group, head_dim, block_size)) % 2**31)
    pages = -(-MAX_SEQ // block_size)
    atol = 2e-5 if dtype == jnp.float32 else 3e-2
    for i, (q_lens, ctx) in enumerate(LAYOUTS + [random_layout(rng) for _ in range(3)]):
        case = make_case(rng, q_lens, ctx, num_tokens=T_PAD, num_rows=R_PAD,
                         num_kv_heads=kv_heads, group=group, head_dim=head_dim,
                         block_size=block_size, pages=pages, num_blocks=R_PAD * pages + 3,
                         dtype=dtype)
        out = fn(*case.kernel_args())
        n = case.num_real_tokens
        want = ragged_paged_attention_ref(*case.kernel_args(), scale=scale,
                                          sliding_window=window, soft_cap=cap)
        jnp_ref = ref_jit(case.q, case.k_new, case.v_new, case.k_cache, case.v_cache,
                          AttentionMetadata(**case.metadata_fields()))
        msg = f"layout {i}: q_lens={q_lens} ctx={ctx}"
        assert out.shape == case.q.shape and out.dtype == case.q.dtype, msg
        np.testing.assert_array_equal(np.asarray(out[n:], np.float32), 0.0, err_msg=msg)
        np.testing.assert_allclose(np.asarray(out[:n], np.float32), want[:n], atol=atol,
                                   rtol=atol, err_msg=msg)
        np.testing.assert_allclose(np.asarray(out[:n], np.float32),
                                   np.asarray(jnp_ref[:n], np.float32), atol=atol, rtol=atol,
                                   err_msg=msg)


@pytest.mark.parametrize("kv_heads,group,head_dim,block_size,window", [
    (3, 3, 64, 16, None), (2, 4, 64, 32, 70), (1, 8, 128, 16, 37), (2, 2, 64, 16, 5)])
def test_prefill_tiles_over_many_key_chunks(kv_heads, group, head_dim, block_size, window):
    """Prefill tiles (>= 8 query vectors: the register-blocked path) behind long contexts:
    several 64-key passes, a window starting inside a pass, partial tiles and blocks. Cache
    slots past each row's length (and unused blocks) hold NaN: never read."""
    q_lens, ctx = [45, 1, 13, 70], [150, 200, 0, 58]
    pages = -(-max(q + c for q, c in zip(q_lens, ctx)) // block_size)
    case = make_case(np.random.default_rng(6), q_lens, ctx, num_tokens=136, num_rows=4,
                     num_kv_heads=kv_heads, group=group, head_dim=head_dim,
                     block_size=block_size, pages=pages, num_blocks=4 * pages + 3)
    args = list(case.kernel_args())
    stale = []
    for c in (case.k_cache, case.v_cache):
        a = np.array(c)
        K, B, bs, H = a.shape
        used = np.zeros(B * bs, bool)
        for r, n in enumerate(case.seq_lens):
            pos = np.arange(n)
            used[case.block_tables[r, pos // bs] * bs + pos % bs] = True
        a.reshape(K, B * bs, H)[:, ~used] = np.nan
        stale.append(jnp.asarray(a))
    args[1], args[2] = stale
    scale = head_dim ** -0.5
    out = np.asarray(jax.jit(functools.partial(ragged_paged_attention, scale=scale,
                                               sliding_window=window))(*args))
    want = ragged_paged_attention_ref(*case.kernel_args(), scale=scale, sliding_window=window)
    n = case.num_real_tokens
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[:n], want[:n], atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(out[n:], 0.0)


def test_write_variant_writes_the_new_keys_then_attends():
    """ragged_paged_attention_write on caches that lack the step's keys: the caches come
    back equal to the case's (which hold them), untouched elsewhere, padding tokens
    (slot outside the cache, or negative) write nothing, and the output is the plain
    kernel's on the filled caches, bit for bit."""
    from kernels_cpu.ragged_paged_attention.kernel import ragged_paged_attention_write
    rng = np.random.default_rng(5)
    for q_lens, ctx in LAYOUTS:
        case = make_case(rng, q_lens, ctx, num_tokens=T_PAD, num_rows=R_PAD,
                         num_kv_heads=3, group=3, head_dim=64, block_size=16, pages=5,
                         num_blocks=R_PAD * 5 + 3)
        n = case.num_real_tokens
        slots = np.array(case.slot_mapping)
        assert (slots[n:] >= case.k_cache.shape[1] * 16).all()   # padding: past the end
        if n < T_PAD:
            slots[n] = -1                                          # and a negative one
        K, B, bs, H = case.k_cache.shape

        def without_new(c):
            a = np.asarray(c).reshape(K, B * bs, H).copy()
            a[:, slots[:n]] = 7.0
            return jnp.asarray(a.reshape(K, B, bs, H))
        kc, vc = without_new(case.k_cache), without_new(case.v_cache)
        args = case.kernel_args()       # q, k_cache, v_cache, cu_q_lens, seq_lens, tables
        fn = jax.jit(functools.partial(ragged_paged_attention_write, scale=0.125))
        out, k2, v2 = fn(case.q, case.k_new, case.v_new, kc, vc, jnp.asarray(slots),
                         *args[3:])
        np.testing.assert_array_equal(np.asarray(k2), np.asarray(case.k_cache))
        np.testing.assert_array_equal(np.asarray(v2), np.asarray(case.v_cache))
        want = ragged_paged_attention(*args, scale=0.125)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


def test_thread_count_does_not_change_results():
    """Each (row, head, tile) is computed by one thread in a fixed order: bit-identical."""
    case = make_case(np.random.default_rng(3), [1, 30, 1, 12, 1], [60, 9, 0, 33, 17],
                     num_tokens=48, num_rows=6, num_kv_heads=3, group=3, head_dim=64,
                     block_size=16, pages=5, num_blocks=40)
    outs = [np.asarray(jax.jit(functools.partial(ragged_paged_attention, scale=0.125,
                                                 num_threads=n))(*case.kernel_args()))
            for n in (1, 2, 5)]
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


def test_bad_block_id_is_an_error_not_a_crash():
    case = make_case(np.random.default_rng(4), [1, 5], [20, 0], num_tokens=8, num_rows=2,
                     num_kv_heads=1, group=2, head_dim=64, block_size=16, pages=2,
                     num_blocks=8)
    tables = np.array(case.block_tables)
    tables[0, 1] = 10_000
    args = list(case.kernel_args())
    args[5] = jnp.asarray(tables)
    with pytest.raises(Exception, match="block id out of range"):
        jax.block_until_ready(ragged_paged_attention(*args, scale=0.125))


def test_loading_the_kernel_keeps_subnormals():
    """The library is not built with -ffast-math, whose crtfastmath would switch the
    whole process to flush-to-zero when it loads (hypothesis, numpy, torch notice)."""
    from kernels_cpu.ragged_paged_attention import build
    build.load()
    tiny = np.float32(1e-40)
    assert tiny * np.float32(1.0) != 0.0


def test_portable_build_on_request(monkeypatch):
    """JAXSERVE_PORTABLE_KERNELS=1: no CPU-specific -march; x86-64 pins the baseline and
    the sources' target_clones dispatch the hot loops. Never -march=native or -ffast-math."""
    import platform
    from kernels_cpu.ragged_paged_attention import build
    monkeypatch.setenv("JAXSERVE_PORTABLE_KERNELS", "1")
    assert build.cpu_level() is None
    cmd = build.compile_command(build.find_compiler())
    assert not [a for a in cmd if "native" in a or "fast-math" in a or "-v4" in a], cmd
    assert "-DJAXSERVE_NO_TARGET_CLONES" not in cmd
    if platform.machine() == "x86_64":
        assert "-march=x86-64" in cmd
        assert "target_clones" in build.HEADERS[0].read_text()      # cpu_kernels.h
        for src in build.SOURCES:           # each source's hot loops take the clones
            assert "JAXSERVE_HOT" in src.read_text() and "cpu_kernels.h" in src.read_text()


def test_level_build_is_keyed_on_the_level(tmp_path, monkeypatch):
    """On an AVX-512 / AVX2 CPU the build targets that x86-64 level; the level is in the
    cache key, so a cache shared with a CPU of another level keeps a library per level."""
    from kernels_cpu.ragged_paged_attention import build
    level = build.cpu_level()
    if level is None:
        pytest.skip("not an x86-64-v3/v4 CPU: the portable build is used here")
    assert level in ("x86-64-v3", "x86-64-v4")
    flags = set(next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags"))
                .partition(":")[2].split())
    assert ("avx512f" in flags) == (level == "x86-64-v4") and "avx2" in flags
    cmd = build.compile_command(build.find_compiler())
    assert f"-march={level}" in cmd and "-DJAXSERVE_NO_TARGET_CLONES" in cmd
    assert not [a for a in cmd if "native" in a or "fast-math" in a], cmd
    keys = {build.library_path(tmp_path)[0]}
    other = "x86-64-v3" if level == "x86-64-v4" else "x86-64-v4"
    monkeypatch.setattr(build, "cpu_level", lambda: other)
    keys.add(build.library_path(tmp_path)[0])
    monkeypatch.setattr(build, "cpu_level", lambda: None)
    keys.add(build.library_path(tmp_path)[0])
    assert len(keys) == 3


def _fake_compiler(path, version: str):
    """A g++ wrapper that reports its own --version: a different compiler identity."""
    path.write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo "{version}"; exit 0; }}\n'
                    'exec g++ "$@"\n')
    path.chmod(0o755)
    return str(path)


def test_cache_key_follows_compiler_identity(tmp_path, monkeypatch):
    import shutil
    from kernels_cpu.ragged_paged_attention import build
    if not shutil.which("g++"):
        pytest.skip("needs g++")
    a = _fake_compiler(tmp_path / "a", "g++ (fake) 12.2.0")
    b = _fake_compiler(tmp_path / "b", "g++ (fake) 13.1.0")
    (tmp_path / "c").mkdir()
    c = _fake_compiler(tmp_path / "c" / "a", "g++ (fake) 12.2.0")   # same version, other path

    def key(cxx):
        monkeypatch.setenv("CXX", cxx)
        return build.library_path(tmp_path)[0]
    here = key(a)
    assert key(a) == here
    assert len({here, key(b), key(c)}) == 3
    monkeypatch.setattr("platform.machine", lambda: "riscv64")   # another architecture
    assert key(a) != here


def test_bad_cxx_names_itself(monkeypatch):
    from kernels_cpu.ragged_paged_attention import build
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(build.KernelUnavailable, match=r"CXX='/nonexistent/g\+\+'.*jnp reference"):
        build.find_compiler()


BUILD_ONCE = """
import sys
from pathlib import Path
from kernels_cpu.ragged_paged_attention import build
build.ensure_built(Path(sys.argv[1]), [sys.argv[2], "-O2", "-shared",
                                        *(str(s) for s in build.SOURCES)])
"""


def test_processes_starting_together_build_the_library_once(tmp_path):
    """Three processes ask for the same missing library at once: one runs the compiler
    (a stand-in that logs each call, takes a second and writes its output), the others
    wait for its lock and find the file."""
    import subprocess
    import sys
    log = tmp_path / "calls.log"
    cxx = tmp_path / "cxx"
    cxx.write_text(f'#!/bin/sh\necho "$*" >> {log}\nsleep 1\n'
                   'while [ $# -gt 1 ]; do [ "$1" = -o ] && touch "$2"; shift; done\n')
    cxx.chmod(0o755)
    lib = tmp_path / "cache" / "kernels" / "lib.so"
    procs = [subprocess.Popen([sys.executable, "-c", BUILD_ONCE, str(lib), str(cxx)])
             for _ in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    assert lib.exists()
    calls = log.read_text().splitlines()
    links = [c for c in calls if " -shared " in f" {c} "]
    assert len(links) == 1, calls
    from kernels_cpu.ragged_paged_attention import build
    assert len(calls) == 1 + len(build.SOURCES), calls     # each source once, one link


NO_COMPILER_RUN = """
import json, sys
sys.path.insert(0, sys.argv[1])
from engine_utils import random_prompts, tiny_config, tiny_tokenizer, tiny_weights
from jaxserve import SamplingParams
from jaxserve.attention import backends
from jaxserve.frontend.llm import LLM
cfg = tiny_config()
# warmup=False: the step shapes these prompts run, not every bucket (nothing here counts
# compiles; a process without the test session's settings would compile them all)
llm = LLM.from_weights(cfg, tiny_weights(cfg), tiny_tokenizer(), max_model_len=128,
                       max_num_seqs=4, max_num_batched_tokens=64, token_buckets=[16, 64],
                       warmup=False)
again = backends.get_attention_backend(None).name       # a second look-up, as a 2nd engine
outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])],
                    SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                    use_tqdm=False)
print(json.dumps({"backend": llm.engine.backend.name, "again": again,
                  "tokens": [o.outputs[0].token_ids for o in outs]}))
"""


def test_without_a_compiler_the_engine_warns_once_and_is_correct(tmp_path):
    """No CXX, no compiler on PATH, empty cache: one warning naming the missing compiler,
    the jnp reference, and the same greedy tokens as transformers."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    from engine_utils import (hf_greedy, hf_model_from_weights, random_prompts, tiny_config,
                              tiny_weights)
    prompts = random_prompts(3, 128, 5, 40, seed=2)
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    (tmp_path / "bin").mkdir()
    env.update(PATH=str(tmp_path / "bin"), JAXSERVE_CACHE=str(tmp_path / "cache"))
    res = subprocess.run([sys.executable, "-c", NO_COMPILER_RUN,
                          str(Path(__file__).resolve().parents[1] / "support"),
                          json.dumps(prompts)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["backend"] == got["again"] == "reference"
    want = ("no C++ compiler (g++/clang++) found: install one, e.g. `apt install g++`, for "
            "the CPU kernels (attention ~10x faster, small-row matmuls); using the jnp "
            "reference attention and XLA's dot")
    assert res.stderr.count(want) == 1, res.stderr[-3000:]
    assert res.stderr.count("C++") == 1, res.stderr[-3000:]
    cfg = tiny_config()
    hf = hf_model_from_weights(cfg, tiny_weights(cfg))
    assert got["tokens"] == [hf_greedy(hf, p, 8) for p in prompts]
