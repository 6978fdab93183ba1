"""llama.cpp as a benchmark peer (used by scripts/bench_vs_llamacpp.py; not a dependency).

* `build()`: downloads PyPI's `llama-cpp-python` sdist, builds `llama-server` and
  `llama-batched-bench` from its vendor/llama.cpp tree (Release, CPU only) under `nice -n 19`,
  and caches the binaries in $JAXSERVE_CACHE/llamacpp (~/.cache/jaxserve/llamacpp).
* `write_f32_gguf()`: an F32 GGUF of a jaxserve-loaded model, so both engines run the same
  fp32 weights (the embedded GGUF is Q4_1, which would make llama.cpp do less work).

    .venv/bin/python scripts/llamacpp_peer.py build    # build only (e.g. ahead of time)
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np

from jaxserve.paths import cache_root

BINARIES = ("llama-server", "llama-batched-bench")


def cache_dir() -> Path:
    return cache_root() / "llamacpp"


def binaries() -> dict[str, Path] | None:
    """The cached binaries, or None when any is missing."""
    paths = {b: cache_dir() / "bin" / b for b in BINARIES}
    return paths if all(p.is_file() for p in paths.values()) else None


def _run(cmd: list[str], cwd: Path | None = None, log: Path | None = None) -> None:
    out = open(log, "ab") if log else None
    try:
        subprocess.run(cmd, cwd=cwd, check=True, stdout=out or sys.stdout,
                       stderr=subprocess.STDOUT)
    finally:
        if out:
            out.close()


def _download_sdist(dst: Path) -> Path:
    hits = sorted(glob.glob(str(dst / "llama_cpp_python-*.tar.gz")))
    if not hits:
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
              "-d", str(dst), "llama-cpp-python"])
        hits = sorted(glob.glob(str(dst / "llama_cpp_python-*.tar.gz")))
    if not hits:
        raise SystemExit("pip download of llama-cpp-python produced no sdist")
    return Path(hits[-1])


def _extract_vendor(sdist: Path, dst: Path) -> Path:
    """Extracts only vendor/llama.cpp from the sdist; returns its directory."""
    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers() if "/vendor/llama.cpp/" in m.name]
        tf.extractall(dst, members=members, filter="data")
    (src,) = glob.glob(str(dst / "llama_cpp_python-*" / "vendor" / "llama.cpp"))
    return Path(src)


def build(jobs: int = 2) -> dict[str, Path]:
    """Builds (once) and returns the llama.cpp binaries; the log is in cache_dir()/build.log."""
    found = binaries()
    if found:
        return found
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    log = root / "build.log"
    found_src = glob.glob(str(root / "src" / "llama_cpp_python-*" / "vendor" / "llama.cpp"))
    # An interrupted build resumes: same sources, ninja rebuilds only what is missing.
    src = Path(found_src[0]) if found_src else _extract_vendor(_download_sdist(root),
                                                               root / "src")
    bdir = root / "build"
    nice = ["nice", "-n", "19"]
    # CPU only, no network code, no UI: the two tools are all the benchmark needs.
    if not (bdir / "build.ninja").is_file():
        _run(nice + ["cmake", "-S", str(src), "-B", str(bdir), "-G", "Ninja",
                     "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON",
                     "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                     "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
                     "-DLLAMA_BUILD_SERVER=ON", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF"], log=log)
    _run(nice + ["cmake", "--build", str(bdir), "-j", str(jobs), "--target", *BINARIES],
         log=log)
    (root / "bin").mkdir(exist_ok=True)
    for b in BINARIES:
        shutil.copy2(bdir / "bin" / b, root / "bin" / b)
    found = binaries()
    assert found is not None
    return found


# ---- an F32 GGUF of jaxserve's weights ----------------------------------------------------
SKIP_KEYS = ("GGUF.", "general.architecture", "general.file_type",
             "general.quantization_version")


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf's permute; inverse of
    jaxserve.model.loader.gguf_file.unpermute_rows)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _copy_metadata(reader, writer) -> None:
    """Every key of the source GGUF (tokenizer, chat template, hyper-parameters) but the
    ones that describe its quantization, which GGUFWriter sets for the new file."""
    from gguf import GGUFValueType
    for key, f in reader.fields.items():
        if key.startswith(SKIP_KEYS):
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == GGUFValueType.ARRAY and len(f.types) > 1 else None
        writer.add_key_value(key, f.contents(), vtype, sub_type=sub)


def write_f32_gguf(src: Path, dst: Path, cfg, weights) -> Path:
    """Writes `weights` (jaxserve's, loaded from `src`) as an all-F32 GGUF at `dst`, with
    `src`'s metadata; tensor names and q/k row order follow `src`."""
    from gguf import GGUFReader, GGUFWriter, LlamaFileType

    from jaxserve.model.export import to_hf_state_dict
    from jaxserve.model.loader.gguf_file import hf_name, unpermute_rows

    reader = GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    state = to_hf_state_dict(cfg, weights)
    heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads}
    tmp = dst.with_suffix(".tmp")
    writer = GGUFWriter(str(tmp), arch)
    _copy_metadata(reader, writer)
    writer.add_file_type(LlamaFileType.ALL_F32)
    for t in reader.tensors:
        a = np.ascontiguousarray(state[hf_name(t.name)], np.float32)
        proj = next((p for p in heads if f".{p}." in hf_name(t.name)), None)
        if proj and arch == "llama":
            a = permute_rows(a, heads[proj])
            assert np.array_equal(unpermute_rows(a, heads[proj]), state[hf_name(t.name)])
        writer.add_tensor(t.name, a)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    return dst


def f32_gguf_for_default_model(llm) -> Path:
    """The cached F32 GGUF of the embedded default model (written on first use)."""
    from jaxserve.model.loader.default_model import MODEL_NAME, default_gguf_path
    dst = cache_dir() / f"{MODEL_NAME}.F32.gguf"
    if not dst.is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        write_f32_gguf(default_gguf_path(), dst, llm.model_config, llm.engine.runner.weights)
    return dst


if __name__ == "__main__":
    if sys.argv[1:] == ["build"]:
        print(build())
    else:
        raise SystemExit(__doc__)
