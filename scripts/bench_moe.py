"""MoE step time against a dense model of the same active parameters (CPU), and the MoE
layer's lowering for TPU / CUDA.

    python scripts/bench_moe.py                     # timings, tokens 1 8 64 256
    python scripts/bench_moe.py --lowering          # export checks only (8 fake devices)

Timings: a Mixtral-like decoder (E experts, top-k, expert hidden F) and a dense Llama
twin whose MLP has k*F hidden units (same matmul work per token; the router adds D*E),
each as one jitted forward + logits over T decode rows with a paged KV cache (every row
at position CTX). Also the MoE block alone three ways: the engine's form (sorted
dispatch, CPU chunk loop), lax.ragged_dot as jax lowers it on CPU (a dense product with
every expert), and the dense twin's MLP. Median of --iters runs, ms; the machine is
shared, so quote ratios.

Lowering: the MoE layer exported with jax.export for tpu and cuda, on one device and
with experts split over 4 devices (EP=4, shard_map + psum); prints how many ragged_dot
ops each module holds (one per expert matmul: 3 per layer) and its all-reduces.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if "--lowering" in sys.argv:      # simulated devices must be set before jax is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.attention.metadata import AttentionMetadata  # noqa: E402
from jaxserve.model import decoder, moe  # noqa: E402
from jaxserve.model.config import ModelConfig  # noqa: E402
from jaxserve.model.layers import mlp, rope_inv_freq  # noqa: E402
from jaxserve.model.params import init_params  # noqa: E402

CTX = 64
BS = 16


def configs(a: argparse.Namespace) -> tuple[ModelConfig, ModelConfig]:
    base = dict(architecture="MixtralForCausalLM", family="mixtral", vocab_size=a.vocab,
                hidden_size=a.hidden, num_layers=a.layers, num_heads=a.heads,
                num_kv_heads=a.kv_heads, head_dim=a.hidden // a.heads)
    moe_cfg = ModelConfig(**base, intermediate_size=a.ffn, num_experts=a.experts,
                          num_experts_per_tok=a.top_k, moe_intermediate_size=a.ffn,
                          norm_topk_prob=True, moe_router="mixtral")
    dense = ModelConfig(**{**base, "architecture": "LlamaForCausalLM", "family": "llama"},
                        intermediate_size=a.top_k * a.ffn)
    return moe_cfg, dense


def decode_md(T: int) -> AttentionMetadata:
    P = -(-(CTX + 1) // BS)
    rows = jnp.arange(T, dtype=jnp.int32)
    pos = jnp.full((T,), CTX, jnp.int32)
    tables = rows[:, None] * P + jnp.arange(P, dtype=jnp.int32)[None, :]
    return AttentionMetadata(positions=pos, slot_mapping=rows * P * BS + pos, token_rows=rows,
                             context_lens=pos, seq_lens=pos + 1,
                             query_start_loc=jnp.arange(T + 1, dtype=jnp.int32),
                             block_tables=tables, logits_indices=rows)


def timed(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


def step_ms(cfg: ModelConfig, T: int, iters: int) -> float:
    w = init_params(cfg, seed=0, scale=0.05)
    kv = decoder.init_kv_cache(cfg, T * (-(-(CTX + 1) // BS)), BS, jnp.float32)
    inv = jnp.asarray(rope_inv_freq(cfg))
    md = decode_md(T)
    toks = jnp.arange(T, dtype=jnp.int32) % cfg.vocab_size

    @jax.jit
    def step(w, kv, toks, md):
        h, kv = decoder.forward(w, kv, toks, md, cfg, inv)
        return decoder.compute_logits(w, h), kv

    return timed(step, w, kv, toks, md, iters=iters)


def block_ms(moe_cfg: ModelConfig, dense: ModelConfig, T: int, iters: int) -> dict[str, float]:
    lm = init_params(moe_cfg.replace(num_layers=1), seed=1, scale=0.05)["layers"][0]
    ld = init_params(dense.replace(num_layers=1), seed=1, scale=0.05)["layers"][0]
    x = jax.random.normal(jax.random.PRNGKey(T), (T, moe_cfg.hidden_size), jnp.float32)

    def ragged(x, layer):      # lax.ragged_dot's own CPU lowering in the same dispatch
        ids, wts = moe.route(x, layer["router"], moe_cfg)
        k, E = ids.shape[1], moe_cfg.num_experts
        order = jnp.argsort(ids.reshape(-1), stable=True)
        sizes = jnp.bincount(ids.reshape(-1), length=E).astype(jnp.int32)
        ys = moe.grouped_mlp_ragged(x[order // k], layer["w_gate_e"], layer["w_up_e"],
                                    layer["w_down_e"], sizes)
        y = jnp.zeros_like(ys).at[order].set(ys).reshape(T, k, -1)
        return moe.combine(y, wts, ids, jnp.ones_like(ids, bool), x.dtype)

    return {"moe": timed(jax.jit(lambda x, l: moe.moe_mlp(x, l, moe_cfg)), x, lm, iters=iters),
            "ragged_cpu": timed(jax.jit(ragged), x, lm, iters=iters),
            "dense": timed(jax.jit(lambda x, l: mlp(x, l)), x, ld, iters=iters)}


def run_timings(a: argparse.Namespace) -> None:
    moe_cfg, dense = configs(a)
    print(f"# {jax.devices()[0].platform}: D={a.hidden} E={a.experts} top-{a.top_k} "
          f"F={a.ffn} (dense twin F={a.top_k * a.ffn}), {a.layers} layers, V={a.vocab}, "
          f"ctx {CTX}, float32, median of {a.iters}; ms")
    print("| tokens | MoE step | dense step | MoE / dense | MoE block | ragged_dot (CPU) "
          "block | dense MLP | block MoE / dense |")
    print("|---|---|---|---|---|---|---|---|")
    for T in a.tokens:
        s_moe, s_dense = step_ms(moe_cfg, T, a.iters), step_ms(dense, T, a.iters)
        b = block_ms(moe_cfg, dense, T, a.iters)
        print(f"| {T} | {s_moe:.2f} | {s_dense:.2f} | {s_moe / s_dense:.2f} | {b['moe']:.2f} | "
              f"{b['ragged_cpu']:.2f} | {b['dense']:.2f} | {b['moe'] / b['dense']:.2f} |",
              flush=True)


def run_lowering(a: argparse.Namespace) -> int:
    from jax import export
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxserve.parallel import ShardingPlan, make_mesh
    from jaxserve.parallel.rules import ShardingRules

    moe_cfg, _ = configs(a)
    layer = jax.eval_shape(lambda: init_params(moe_cfg.replace(num_layers=1))["layers"][0])
    failed = 0
    for ep in (1, 4):
        cfg, shardings = moe_cfg, None
        if ep > 1:
            plan = ShardingPlan.build(moe_cfg, make_mesh(ep),
                                      ShardingRules.load().expert_parallel(), log_summary=False)
            cfg = plan.runtime_cfg
            shardings = plan.param_shardings()["layers"][0]
        for T in a.tokens:
            x = jax.ShapeDtypeStruct((T, cfg.hidden_size), jnp.float32,
                                     sharding=None if ep == 1 else
                                     NamedSharding(plan.mesh, P()))
            lay = layer if ep == 1 else jax.tree_util.tree_map(
                lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), layer,
                shardings)
            fn = jax.jit(lambda x, l, c=cfg: moe.moe_mlp(x, l, c))
            for platform in ("tpu", "cuda"):
                try:
                    text = export.export(fn, platforms=[platform])(x, lay).mlir_module()
                except Exception as e:  # report and continue: this is a check script
                    failed += 1
                    print(f"FAIL {platform} ep={ep} tokens={T} {type(e).__name__}: "
                          f"{str(e)[:200]}")
                    continue
                n = text.count("composite \"chlo.ragged_dot\"")
                ar = text.count("all_reduce")
                ok = n == 3 and (ep == 1 or ar >= 1)
                failed += not ok
                print(f"{'OK' if ok else 'FAIL'} {platform} ep={ep} tokens={T} "
                      f"ragged_dot={n} all_reduce={ar}", flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--ffn", type=int, default=1024, help="one expert's hidden size")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--lowering", action="store_true")
    a = p.parse_args(argv)
    if a.lowering:
        return run_lowering(a)
    run_timings(a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
