#!/usr/bin/env python
"""What serving LoRA adapters costs, measured side by side in one run.

1. The delta of one projection (model/lora.py) in its three formulations, at the default
   model's shapes, next to the base projection: "masked" (every slot's shrink as one
   product, a one-hot mask, one expand product), "gather" (each token's A and B
   gathered, then per-token products: Punica's BGMV written in jnp) and "blocked"
   (tokens grouped by slot in padded blocks, SGMV-style); `step_uses` is the one the
   step takes at that size (lora.form).
2. The engine: the same greedy workload on an engine without LoRA and on one with
   --enable-lora, the requests spread over `--adapters` random adapters of rank
   `--rank` on every target (and the same workload as base requests on the LoRA
   engine, and the adapter requests on a LoRA engine without the grouped form); output
   tokens per second, and the decode step time at batch 1.

    .venv/bin/python -m jaxserve.tools.bench_lora [--model PATH] [--adapters 4] [--rank 16]
        [--requests 16] [--max-tokens 32]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from jaxserve.model import lora as lora_model


def _median_ms(f: Callable[[], Any], n: int = 20) -> float:
    jax.block_until_ready(f())
    times = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f())
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def bench_delta(d_in: int, d_out: int, slots: int, rank: int,
                tokens: tuple[int, ...]) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    ab = {"a": jnp.asarray(rng.standard_normal((d_in, slots, rank)), jnp.float32),
          "b": jnp.asarray(rng.standard_normal((slots, rank, d_out)), jnp.float32)}
    w = jnp.asarray(rng.standard_normal((d_in, d_out)), jnp.float32)
    rows = []
    for t in tokens:
        x = jnp.asarray(rng.standard_normal((t, d_in)), jnp.float32)
        s = jnp.asarray(rng.integers(0, slots, t), jnp.int32)
        masked = jax.jit(lora_model.delta_masked)
        gather = jax.jit(lora_model.delta_gather)
        blocked = jax.jit(lora_model.delta_blocked)
        base = jax.jit(lambda x, w: x @ w)
        rows.append({"tokens": t, "step_uses": lora_model.form(t, slots),
                     "base_matmul_ms": _median_ms(lambda: base(x, w)),
                     "masked_ms": _median_ms(lambda: masked(x, s, ab)),
                     "gather_ms": _median_ms(lambda: gather(x, s, ab)),
                     "blocked_ms": _median_ms(lambda: blocked(x, s, ab))})
    return rows


def save_random_adapter(path: Path, cfg: Any, rank: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    shapes = lora_model.target_shapes(cfg)
    tensors = {}
    for i in range(cfg.num_layers):
        for module, key in lora_model.TARGETS.items():
            fin, fout = shapes[key]
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            pre = f"base_model.model.model.layers.{i}.{part}.{module}"
            tensors[f"{pre}.lora_A.weight"] = (rng.standard_normal((rank, fin)) * 0.01
                                               ).astype(np.float32)
            tensors[f"{pre}.lora_B.weight"] = (rng.standard_normal((fout, rank)) * 0.01
                                               ).astype(np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
         "target_modules": list(lora_model.TARGETS)}))
    return path


def bench_engine(args: argparse.Namespace) -> dict[str, Any]:
    from jaxserve.frontend.llm import LLM
    from jaxserve.lora import LoRARequest
    from jaxserve.model.loader.load import load_model
    from jaxserve.sampling.params import SamplingParams
    loaded = load_model(args.model)
    cfg = loaded.config
    engine_args = dict(max_model_len=256, max_num_seqs=args.requests,
                       max_num_batched_tokens=256, token_buckets=[args.requests, 256])
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(100, 20000, 32)]}
               for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {}

    def run(llm: Any, loras: list[Any]) -> float:
        llm.generate(prompts[:2], params, use_tqdm=False, lora_request=loras[:2])  # warm
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        return args.requests * args.max_tokens / (time.perf_counter() - t)

    def decode_ms(llm: Any, lora: Any) -> float:
        one = SamplingParams(max_tokens=65, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts[:1], SamplingParams(max_tokens=1, temperature=0.0),
                     use_tqdm=False, lora_request=[lora])
        first = time.perf_counter() - t
        t = time.perf_counter()
        llm.generate(prompts[:1], one, use_tqdm=False, lora_request=[lora])
        return 1e3 * (time.perf_counter() - t - first) / 64

    base = LLM.from_weights(cfg, loaded.weights, loaded.tokenizer, **engine_args)
    out["base_engine_tok_s"] = run(base, [None] * args.requests)
    out["base_engine_decode_ms_b1"] = decode_ms(base, None)
    del base
    with tempfile.TemporaryDirectory() as tmp:
        reqs = [LoRARequest(f"a{i}", i + 1, str(save_random_adapter(
            Path(tmp) / f"a{i}", cfg, args.rank, i))) for i in range(args.adapters)]
        spread = [reqs[i % args.adapters] for i in range(args.requests)]
        # the same engine without the grouped form (the choice is made at trace time)
        lora_model.GROUPED = False
        llm = LLM.from_weights(cfg, loaded.weights, loaded.tokenizer, enable_lora=True,
                               max_loras=args.adapters, max_lora_rank=args.rank,
                               **engine_args)
        out["lora_engine_adapter_requests_tok_s_without_grouped"] = run(llm, spread)
        del llm
        lora_model.GROUPED = True
        llm = LLM.from_weights(cfg, loaded.weights, loaded.tokenizer, enable_lora=True,
                               max_loras=args.adapters, max_lora_rank=args.rank,
                               **engine_args)
        out["lora_engine_base_requests_tok_s"] = run(llm, [None] * args.requests)
        out["lora_engine_adapter_requests_tok_s"] = run(llm, spread)
        out["lora_engine_decode_ms_b1"] = decode_ms(llm, reqs[0])
        slots, weights = llm.engine.runner.lora_slots, llm.engine.runner.weights
        adapters = [llm.lora_registry.get(r) for r in reqs] if llm.lora_registry else []
        t = time.perf_counter()
        for i in range(8):          # different adapters into one slot: each a full write
            slots.write(weights, 1, adapters[i % len(adapters)])
        jax.block_until_ready(weights["layers"][0]["lora"])
        out["slot_write_ms"] = 1e3 * (time.perf_counter() - t) / 8
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--skip-engine", action="store_true")
    args = p.parse_args()
    from jaxserve.model.config import ModelConfig
    from jaxserve.model.loader.default_model import default_model_path
    from jaxserve.model.loader.safetensors_dir import read_json
    cfg = ModelConfig.from_hf_dict(read_json(Path(args.model or default_model_path())
                                        / "config.json"))
    shapes = lora_model.target_shapes(cfg)
    result: dict[str, Any] = {"device": str(jax.devices()[0]), "rank": args.rank,
                              "slots": args.adapters + 1}
    for key in ("wq", "w_gate"):
        result[f"delta_{key}"] = bench_delta(*shapes[key], args.adapters + 1, args.rank,
                                             (1, 16, 256))
    if not args.skip_engine:
        result["engine"] = bench_engine(args)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
