"""Run llama.cpp's own convert_hf_to_gguf.py on the tiny Gemma 2 / Gemma 3 test checkpoints
and check that (a) its file equals the one tests/gemma_gguf.py writes (every tensor, and
every `<arch>.*` metadata key) and (b) jaxserve loads it to transformers' logits.

The converter source is the one scripts/llamacpp_peer.py caches (llama-cpp-python's
sdist, vendor/llama.cpp). Two patches, both about the test tokenizer, not the model: the
character-level tokenizer has no registered BPE pre-tokenizer hash (named "default"), and
Gemma 2's converter path wants a sentencepiece tokenizer.model (the gpt2 path is used).

    .venv/bin/python scripts/check_gemma_gguf_converter.py
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / d) for d in ("support", "model")] + [str(ROOT / "scripts")]

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


def converter_source() -> Path:
    import glob

    import llamacpp_peer
    hits = glob.glob(str(llamacpp_peer.cache_dir() / "src" / "llama_cpp_python-*" / "vendor"
                         / "llama.cpp"))
    if not hits:
        sys.exit("llama.cpp source not cached: run scripts/llamacpp_peer.py build first")
    return Path(sorted(hits)[-1])


def compare(a: Path, b: Path, arch: str) -> list[str]:
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


def main() -> int:
    from gemma_gguf import write_gemma_gguf
    from jaxserve.model.loader.gguf_file import read_gguf
    from model_utils import Generator, hf_logits, tiny_tokenizer
    from test_gemma_gguf import GGUF_MODELS, transformers_from_gguf
    from test_model_gemma import TEXTS, make_gemma

    src = converter_source()
    ok = True
    for variant, over in sorted(GGUF_MODELS.items()):
        with tempfile.TemporaryDirectory() as d:
            d = Path(d)
            model, tok = make_gemma(variant, seed=4, **over), tiny_tokenizer()
            model.save_pretrained(str(d / "hf"), safe_serialization=True)
            tok.save_pretrained(str(d / "hf"))
            out = d / "converter.gguf"
            proc = subprocess.run([sys.executable, "-c", RUNNER, str(src), str(d / "hf"),
                                   "--outfile", str(out), "--outtype", "f32"],
                                  capture_output=True, text=True)
            if proc.returncode:
                print(proc.stdout[-3000:], proc.stderr[-3000:])
                return 1
            write_gemma_gguf(d / "writer.gguf", model, tok)
            arch = "gemma2" if variant == "gemma2" else "gemma3"
            problems = compare(out, d / "writer.gguf", arch)
            cfg, w = read_gguf(out)
            prompts = [tok(t).input_ids for t in TEXTS]
            hf = transformers_from_gguf(out)
            diffs = [max(np.abs(g - hf_logits(model, p)).max(),
                         np.abs(g - hf_logits(hf, p)).max())
                     for p, g in zip(prompts, Generator(w, cfg).logits(prompts))]
            print(f"{variant}: converter vs test writer: "
                  f"{'identical' if not problems else problems}; jaxserve on the converter's "
                  f"file vs transformers (safetensors and the same GGUF): max |logit diff| "
                  f"{max(diffs):.2e}")
            ok &= max(diffs) < 1e-4
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
