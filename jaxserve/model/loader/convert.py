"""`jaxserve convert SRC DST`: any supported checkpoint -> jaxserve's orbax format."""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Sequence

from jaxserve.model.loader.load import load_model
from jaxserve.model.loader.orbax_dir import save_orbax


def convert(src: str | Path | None, dst: str | Path, dtype: str = "auto") -> Path:
    """Load `src` (None: the default model, dequantized) and write an orbax dir at `dst`
    (float weights: the format has no quantized matrices)."""
    lm = load_model(None if src is None else str(src), dtype=dtype, quantization="none")
    dst = Path(dst)
    save_orbax(dst, lm.config, lm.weights)
    lm.tokenizer.save_pretrained(str(dst))
    return dst


def convert_main(args: Sequence[str] | None = None) -> int:
    """CLI entry: `jaxserve convert SRC DST [--dtype auto|float32|bfloat16]`."""
    p = argparse.ArgumentParser(prog="jaxserve convert",
                                description="Convert a safetensors dir or GGUF file into "
                                            "jaxserve's orbax format (fast to load).")
    p.add_argument("src", help="HF safetensors directory, .gguf file or orbax directory")
    p.add_argument("dst", help="output directory (must not exist)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ns = p.parse_args(args)
    dst = Path(ns.dst)
    if dst.exists():
        p.error(f"{dst} already exists")
    t0 = time.perf_counter()
    convert(ns.src, dst, ns.dtype)
    print(f"wrote {dst} in {time.perf_counter() - t0:.1f}s")
    return 0
