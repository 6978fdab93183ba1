"""llama.cpp's own convert_hf_to_gguf.py on the tiny Gemma 2 / Gemma 3 checkpoints: jaxserve
loads its file to transformers' logits, and how it differs from the one tests/support/gemma_gguf.py
writes (every tensor, every `<arch>.*` metadata key) is printed.

Skipped unless the llama.cpp source tree is cached: `python -m benchmarks.harness build`
puts it under $JAXSERVE_CACHE/llamacpp/src (llama-cpp-python's sdist, vendor/llama.cpp).
Two patches, both about the test tokenizer, not the model: the character-level
tokenizer has no registered BPE pre-tokenizer hash (named "default"), and Gemma 2's
converter path wants a sentencepiece tokenizer.model (the gpt2 path is used).
"""
from __future__ import annotations

import glob
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gemma_gguf import write_gemma_gguf
from jaxserve.paths import cache_root
from jaxserve.model.loader.gguf_file import read_gguf
from model_utils import Generator, hf_logits, tiny_tokenizer
from test_gemma_gguf import GGUF_MODELS, transformers_from_gguf
from test_model_gemma import TEXTS, make_gemma

# The converter is a script tree, not an installed package: the child process puts it on
# its own path, so this interpreter never imports llama.cpp's gguf-py over the installed one.
RUNNER = r"""
import sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
import runpy
import conversion.base as base
import conversion.gemma as gemma
base.TextModel.get_vocab_base_pre = lambda self, tok: "default"
gemma.Gemma2Model.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def converter_source() -> Path | None:
    # where benchmarks/harness.py's build() extracts the sdist
    hits = glob.glob(str(cache_root() / "llamacpp" / "src" / "llama_cpp_python-*" / "vendor"
                         / "llama.cpp"))
    return Path(sorted(hits)[-1]) if hits else None


def differences(a: Path, b: Path, arch: str) -> list[str]:
    from gguf import GGUFReader
    ra, rb = GGUFReader(str(a)), GGUFReader(str(b))
    problems = []
    ta = {t.name: np.asarray(t.data) for t in ra.tensors}
    tb = {t.name: np.asarray(t.data) for t in rb.tensors}
    if set(ta) != set(tb):
        problems.append(f"tensor names differ: {sorted(set(ta) ^ set(tb))}")
    for n in set(ta) & set(tb):
        if ta[n].shape != tb[n].shape or not np.array_equal(ta[n], tb[n]):
            problems.append(f"tensor {n} differs")
    keys = {k for k in (*ra.fields, *rb.fields) if k.startswith(arch + ".")}
    for k in sorted(keys):
        va = ra.fields[k].contents() if k in ra.fields else None
        vb = rb.fields[k].contents() if k in rb.fields else None
        if va != vb:
            problems.append(f"metadata {k}: converter {va!r}, test writer {vb!r}")
    return problems


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(GGUF_MODELS))
def test_converter_file_matches_the_test_writer(variant: str, tmp_path: Path) -> None:
    src = converter_source()
    if src is None:
        pytest.skip("llama.cpp source not cached: python -m benchmarks.harness build")
    model = make_gemma(variant, seed=4, **GGUF_MODELS[variant])
    tok = tiny_tokenizer()
    model.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    tok.save_pretrained(str(tmp_path / "hf"))
    out = tmp_path / "converter.gguf"
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(src), str(tmp_path / "hf"),
                           "--outfile", str(out), "--outtype", "f32"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    write_gemma_gguf(tmp_path / "writer.gguf", model, tok)
    arch = "gemma2" if variant == "gemma2" else "gemma3"
    # reported, not asserted: the logits below are the contract, and the byte-for-byte
    # comparison is what to read when they drift
    problems = differences(out, tmp_path / "writer.gguf", arch)
    print(f"{variant}: converter vs test writer: {problems or 'identical'}")
    cfg, w = read_gguf(out)
    prompts = [tok(t).input_ids for t in TEXTS]
    hf = transformers_from_gguf(out)
    for p, got in zip(prompts, Generator(w, cfg).logits(prompts)):
        assert np.abs(got - hf_logits(model, p)).max() < 1e-4
        assert np.abs(got - hf_logits(hf, p)).max() < 1e-4
