#!/usr/bin/env python
"""Programs compiled at warm-up for a config's shapes, counted with the engine's own
compile counter, on this host: a small random model stands in for the config's model
(the count depends on the buckets, rows and step form, not on the model's sizes).

    .venv/bin/python -m jaxserve.tools.count_programs [--config configs/gpu_h200_llama3-8b.yaml]
        [--platform gpu]

--platform gpu builds the step as a GPU would (fused, branch-free sampler programs;
one block-table width, as the CPU attention backend also compiles). The store of
compiled programs is off for the count (a second start loads them all: 0 compiles).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
             num_kv_heads=2, head_dim=16)


def count(config: Path, platform: str, num_blocks: int | None = None) -> dict:
    """Build the engine for `config`'s shapes on the small model; warm it up; count."""
    from jaxserve.config import EngineArgs
    from jaxserve.frontend.llm import LLM
    from jaxserve.model.config import ModelConfig
    from jaxserve.model.params import init_params
    from jaxserve.worker import step_config
    args = EngineArgs.from_sources(config)
    if platform != "cpu":
        step_config.step_platform = lambda plan: platform  # type: ignore[assignment]
    cfg = ModelConfig(architecture="LlamaForCausalLM", family="llama",
                      max_position_embeddings=args.max_model_len or 2048, eos_token_ids=(2,),
                      **SMALL)
    pages = -(-(args.max_model_len or 2048) // args.block_size)
    kw = {f: getattr(args, f) for f in ("max_model_len", "block_size", "max_num_seqs",
                                        "max_num_batched_tokens", "token_buckets",
                                        "long_prefill_token_threshold")}
    t0 = time.perf_counter()
    llm = LLM.from_weights(cfg, init_params(cfg, seed=0), None, skip_tokenizer_init=True,
                           dtype="float32", step_mode="fused" if platform != "cpu" else "auto",
                           num_kv_blocks=num_blocks or pages + 1,
                           enable_prefix_caching=False, **kw)
    runner = llm.engine.runner
    b = runner.buckets
    rows = sorted({b.sampler_rows(b.rows_for(t)) for t, _ in b.all_shapes()})
    return {"config": str(config), "platform": platform, "programs": runner.num_compiles,
            "shapes": len(b.all_shapes()), "token_buckets": list(b.token_buckets),
            "sampler_rows": rows, "sampler_plans": len(runner.plans),
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "gpu_h200_llama3-8b.yaml")
    ap.add_argument("--platform", default="gpu", choices=("gpu", "tpu", "cpu"))
    ns = ap.parse_args()
    # count compiles: nothing loaded from the stored step programs
    os.environ["JAXSERVE_EXECUTABLE_CACHE"] = "0"
    print(json.dumps(count(ns.config, ns.platform)))


if __name__ == "__main__":
    main()
