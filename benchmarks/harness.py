"""What the benchmarks share: servers on loopback (jaxserve and its peers), timing them,
and the two peers themselves. Not a dependency of jaxserve.

* `Server`, `free_port`, `bench_serve`: a server subprocess stopped by its PID, and
  `jaxserve bench serve` against its URL.
* llama.cpp: `build()` downloads PyPI's `llama-cpp-python` sdist, builds `llama-server`
  and `llama-batched-bench` from its vendor/llama.cpp tree (Release, CPU only) under
  `nice -n 19`, and caches the binaries in $JAXSERVE_CACHE/llamacpp
  (~/.cache/jaxserve/llamacpp); `gguf_for_default_model()` gives the embedded model as
  an F32, Q8_0 or Q4_1 (the embedded file) GGUF, so both engines read the same file
  (`write_f32_gguf()` writes the first two from jaxserve's float32 weights);
  `llamacpp_decode()` times llama-batched-bench.
* transformers: `hf_model_from()` and its `generate` / `generate_batch` timed.
* KV transfer: `KVPullRig`, a producer's transfer server and a consumer's pool on
  loopback with SmolLM2-135M's KV geometry, timing one pull (gather, stream, scatter).

    .venv/bin/python -m benchmarks.harness build    # build llama.cpp only (ahead of time)
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.paths import cache_root

PY = sys.executable
THREADS = os.cpu_count() or 1      # llama.cpp's threads (--threads); jaxserve uses every core


# ---- servers on loopback ------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    import httpx
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server at {url} not ready after {timeout:.0f} s")


class Server:
    """A server subprocess on loopback, stopped by its PID."""

    def __init__(self, cmd: list[str], port: int, log: Path, ready_timeout: float) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            _wait_ready(self.url, self.proc, ready_timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def bench_serve(url: str, args: list[str], out: Path, time_limit: float) -> dict[str, Any]:
    """`jaxserve bench serve` once (bounded by --num-prompts and `time_limit`)."""
    cmd = [PY, "-m", "jaxserve.cli", "bench", "serve", "--url", url, "--vocab-size", "49152",
           "--no-reset-prefix-cache", "--timeout", str(time_limit), "--output-json", str(out),
           *args]
    subprocess.run(cmd, capture_output=True, text=True, timeout=time_limit + 60)
    run = json.loads(out.read_text())["runs"][0]
    keys = ("completed", "failed", "duration_s", "output_throughput", "mean_ttft_ms",
            "p50_ttft_ms", "mean_itl_ms", "p50_itl_ms", "mean_tpot_ms", "errors")
    return {k: run.get(k) for k in keys}


# ---- llama.cpp: the build ----------------------------------------------------------------
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
        # only this package as an sdist: its build requirements come as wheels (with
        # ":all:" pip would build scikit-build-core and its own requirements from source)
        _run([sys.executable, "-m", "pip", "download", "--no-binary", "llama-cpp-python",
              "--no-deps", "-d", str(dst), "llama-cpp-python"])
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


# ---- llama.cpp: timing --------------------------------------------------------------------
def llamacpp_decode(bins: dict[str, Path], gguf: Path, batches: list[int], input_len: int,
                    output_len: int) -> dict[int, dict[str, float]]:
    ctx = max(batches) * (input_len + output_len) + 256
    cmd = [str(bins["llama-batched-bench"]), "-m", str(gguf), "-c", str(ctx), "-b", "2048",
           "-ub", "512", "-npp", str(input_len), "-ntg", str(output_len),
           "-npl", ",".join(map(str, batches)), "-t", str(THREADS), "-tb", str(THREADS),
           "--output-format", "jsonl", "-kvu"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {r["pl"]: {"decode_tok_s": r["speed_tg"], "prefill_s": r["t_pp"],
                      "e2e_tok_s": r["pl"] * r["tg"] / r["t"]} for r in rows}



# ---- an F32 GGUF of jaxserve's weights ----------------------------------------------------
SKIP_KEYS = ("GGUF.", "general.architecture", "general.file_type",
             "general.quantization_version")


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf's permute; inverse of
    jaxserve.model.loader.gguf_file.unpermute_rows)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _copy_metadata(reader: Any, writer: Any) -> None:
    """Every key of the source GGUF (tokenizer, chat template, hyper-parameters) but the
    ones that describe its quantization, which GGUFWriter sets for the new file."""
    from gguf import GGUFValueType
    for key, f in reader.fields.items():
        if key.startswith(SKIP_KEYS):
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == GGUFValueType.ARRAY and len(f.types) > 1 else None
        writer.add_key_value(key, f.contents(), vtype, sub_type=sub)


def write_f32_gguf(src: Path, dst: Path, cfg: Any, weights: Any, qtype: str = "F32") -> Path:
    """Writes `weights` (jaxserve's, loaded from `src`) as a GGUF at `dst`, with `src`'s
    metadata; tensor names and q/k row order follow `src`. qtype "F32": every tensor
    float32; "Q8_0": the matrices quantized by gguf-py (llama.cpp's Q8_0), the norms F32."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, LlamaFileType
    from gguf.quants import quantize

    from jaxserve.model.export import to_hf_state_dict
    from jaxserve.model.loader.gguf_file import hf_name, unpermute_rows

    reader = GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    state = to_hf_state_dict(cfg, weights)
    heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads}
    tmp = dst.with_suffix(".tmp")
    writer = GGUFWriter(str(tmp), arch)
    _copy_metadata(reader, writer)
    q8 = qtype == "Q8_0"
    writer.add_file_type(LlamaFileType.MOSTLY_Q8_0 if q8 else LlamaFileType.ALL_F32)
    for t in reader.tensors:
        a = np.ascontiguousarray(state[hf_name(t.name)], np.float32)
        proj = next((p for p in heads if f".{p}." in hf_name(t.name)), None)
        if proj and arch == "llama":
            a = permute_rows(a, heads[proj])
            assert np.array_equal(unpermute_rows(a, heads[proj]), state[hf_name(t.name)])
        if q8 and a.ndim == 2:
            writer.add_tensor(t.name, quantize(a, GGMLQuantizationType.Q8_0),
                              raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(t.name, a)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    return dst


def gguf_for_default_model(qtype: str) -> Path:
    """The embedded default model as a GGUF of `qtype`: "Q4_1" is the embedded file
    itself; "F32" / "Q8_0" are written once (cached) from its float32 weights (the Q4_1
    file dequantized), "Q8_0" quantized by gguf-py as llama.cpp's converter would."""
    from jaxserve.model.loader.load import load_model
    from jaxserve.model.loader.default_model import MODEL_NAME, default_gguf_path
    if qtype == "Q4_1":
        return default_gguf_path()
    dst = cache_dir() / f"{MODEL_NAME}.{qtype}.gguf"
    if not dst.is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        lm = load_model(None, progress=False, quantization="none", skip_tokenizer=True)
        write_f32_gguf(default_gguf_path(), dst, lm.config, lm.weights, qtype=qtype)
    return dst


# ---- transformers --------------------------------------------------------------------------
def hf_model_from(llm: Any) -> Any:
    """transformers' model of the LLM's loaded weights."""
    from jaxserve.model.export import to_transformers
    return to_transformers(llm.model_config, llm.engine.runner.weights)


def bench_hf_static(model: Any, prompts: list[list[int]], output_len: int, pad_id: int,
                    batch: int = 16) -> dict:
    import torch
    import transformers
    gen = transformers.GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len,
                                        do_sample=False, pad_token_id=pad_id)
    t0 = time.perf_counter()
    n_out = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            L = max(len(p) for p in chunk)
            ids = torch.tensor([[pad_id] * (L - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in chunk])
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
            n_out += (out.shape[1] - L) * len(chunk)
    secs = time.perf_counter() - t0
    return {"seconds": secs, "output_tokens_per_s": n_out / secs}


def bench_hf_batch(model: Any, prompts: list[list[int]], output_len: int,
                   pad_id: int) -> dict:
    import torch
    import transformers
    gen = transformers.GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len,
                                        do_sample=False, pad_token_id=pad_id, eos_token_id=-1)
    t0 = time.perf_counter()
    with torch.inference_mode():
        res = model.generate_batch(prompts, generation_config=gen)
    secs = time.perf_counter() - t0
    n_out = sum(len(r.generated_tokens) for r in res.values())
    return {"seconds": secs, "output_tokens_per_s": n_out / secs}


if __name__ == "__main__":
    if sys.argv[1:] == ["build"]:
        print(build())
    else:
        raise SystemExit(__doc__)


class KVPullRig:
    """SmolLM2-135M's KV geometry (30 layers, 3 KV heads, block 16, head dim 64, float32)
    in a pool of `pool_blocks` on a producer and a consumer, with the producer's transfer
    server on 127.0.0.1. `pull(n)` times one transfer of n blocks: gather on the producer,
    the stream with its handshake and CRC, scatter on the consumer. Close it after use."""

    def __init__(self, pool_blocks: int, random_values: bool = False) -> None:
        import jax.numpy as jnp
        from jaxserve.kv_transfer.blocks import BlockMover
        from jaxserve.kv_transfer.transport import SavedStore, TransferServer
        L, K, S, H = 30, 3, 16, 64
        rng = np.random.default_rng(0)
        shape = (K, pool_blocks, S, H)

        def layer() -> Any:
            if random_values:
                return jnp.asarray(rng.standard_normal(shape, np.float32))
            return jnp.ones(shape, jnp.float32)
        self.kv = [(layer(), layer()) for _ in range(L)]
        self.mover = BlockMover(self.kv, 16)
        self.dst = self.mover.warmup([(jnp.zeros_like(k), jnp.zeros_like(v))
                                      for k, v in self.kv])
        self.store = SavedStore(1 << 34, 60)
        self.geometry = [L, K, S, H, "<f4"]
        self.server = TransferServer(
            self.store, lambda s: self.mover.to_host(s.chunks, s.num_blocks),
            self.geometry, host="127.0.0.1", port=0, secret=b"bench", timeout=60)
        self._pulls = 0

    @property
    def bytes_per_block(self) -> int:
        return int(self.mover.bytes_per_block)

    def pull(self, n: int, wire: str = "native") -> float:
        """Seconds for one pull of blocks [0, n) into the consumer's blocks [n, 2n)."""
        import jax
        from jaxserve.kv_transfer.transport import fetch
        tid = str(self._pulls)
        self._pulls += 1
        t0 = time.perf_counter()
        self.store.put(tid, self.mover.gather(self.kv, list(range(n))), n, b"d",
                       n * self.mover.bytes_per_block)
        data = fetch("127.0.0.1", self.server.port, transfer_id=tid, first_block=0,
                     num_blocks=n, digest=b"d", geometry=self.geometry,
                     shape=self.mover.host_shape(n), dtype=self.mover.dtype,
                     secret=b"bench", timeout=60, wire=wire)
        self.dst = self.mover.scatter(self.dst, list(range(n, 2 * n)), data)
        jax.block_until_ready(self.dst)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.server.close()
