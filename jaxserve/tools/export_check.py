"""Export the engine's fused step for TPU or CUDA from a CPU host: does every bucket lower?

    python -m jaxserve.tools.export_check --platform tpu --shape llama3-8b --tp 8
    python -m jaxserve.tools.export_check --platform tpu --shape llama3-8b --tp 4 --dp 2
    python -m jaxserve.tools.export_check --platform cuda --shape llama3-8b --tp 1 --max-buckets 2
    python -m jaxserve.tools.export_check --platform tpu --shape gemma3-4b --tp 4   # sliding windows
    python -m jaxserve.tools.export_check --platform tpu --tp 8 --decode-steps 4   # multi-step decode
    python -m jaxserve.tools.export_check --platform tpu --tp 8 --tpu-kernel pm    # page-major kernel
    python -m jaxserve.tools.export_check --platform cuda --enable-lora --max-loras 4 --max-lora-rank 16
    python -m jaxserve.tools.export_check --platform cuda --quantization int8  # int8 weights

For each (tokens, block-table width) bucket the engine would compile, the whole fused
step (all layers, logits, sampler) with the Pallas attention backend is traced with
abstract weights (jax.ShapeDtypeStruct: random weights never exist), sharded with the
engine's ShardingPlan over simulated CPU devices, and exported with jax.export for the
target platform: Mosaic / Triton lowering and SPMD partitioning run, nothing executes.
One line per bucket:

    OK tpu tokens=128 width=256 kernel_calls=32 (4.1 s)
    FAIL cuda tokens=8192 width=512 <reason>

kernel_calls counts the attention kernel's custom calls (tpu_custom_call / Triton) in
the exported module, one per layer when all is well; 0 is a failure (attention fell
back to something else), and so is a sharded step with fewer shard_map regions than
kernel calls (XLA cannot partition a kernel). Exits 1 if any bucket failed.

With --quantization int8 the projections are int8 weight-only QArrays (embedding and
head float, as the loader makes them); with q8_0, q4_0, q4_1 or q4_k they are GGUF
blocks of that format (embedding and head Q8_0, as in llama.cpp's files). In every
bucket of up to KERNEL_ROWS tokens the check also asserts that no dequantized weight
matrix exists outside a custom call (tools/export_quant.py); the line then adds
quant_calls, the quantized-matmul kernel's calls (kernel_calls counts the attention
kernel's only); under TP each runs per device in a shard_map region. --quant-kernel off
lowers the same step on XLA's dot, which the check reports as materialized weights.

Engine settings (buckets, block size, max_model_len) come from the platform's shipped
config (configs/tpu_v5e-8_llama3-8b.yaml, configs/gpu_h200_llama3-8b.yaml) or --config.
With --dp M the engine runs M replicas, each a TP group with its own step; replica 0's
step is exported (the others are the same program on other devices).
"""
from __future__ import annotations

import contextlib
import argparse
import dataclasses
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {"tpu": ROOT / "configs" / "tpu_v5e-8_llama3-8b.yaml",
           "cuda": ROOT / "configs" / "gpu_h200_llama3-8b.yaml"}
KERNEL_TARGETS = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}
LLAMA3_ROPE = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
               ("original_max_position_embeddings", 8192), ("rope_type", "llama3"))
SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                      rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                      max_position_embeddings=131072),
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                       num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                       rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                       max_position_embeddings=131072),
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                    num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                    rope_theta=100000.0, max_position_embeddings=8192,
                    tie_word_embeddings=True),
}
# Gemma shapes (sliding-window + global layers, soft-caps, head_dim 256) as HF configs,
# parsed by the loader's own ModelConfig.from_hf_dict
HF_SHAPES: dict[str, dict[str, Any]] = {
    "gemma3-4b": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                      vocab_size=262208, hidden_size=2560, intermediate_size=10240,
                      num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
                      rope_local_base_freq=10000.0, sliding_window=1024,
                      rope_scaling={"rope_type": "linear", "factor": 8.0},
                      query_pre_attn_scalar=256, max_position_embeddings=131072,
                      hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
    "gemma2-9b": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2",
                      vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                      num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
                      head_dim=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                      sliding_window=4096, attn_logit_softcapping=50.0,
                      final_logit_softcapping=30.0, query_pre_attn_scalar=256,
                      max_position_embeddings=8192, hidden_activation="gelu_pytorch_tanh",
                      tie_word_embeddings=True),
}


def model_config(shape: str) -> Any:
    from jaxserve.model.config import ModelConfig
    if shape in HF_SHAPES:
        return ModelConfig.from_hf_dict(HF_SHAPES[shape])
    return ModelConfig(architecture="LlamaForCausalLM", family="llama", **SHAPES[shape])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--platform", choices=sorted(KERNEL_TARGETS), required=True)
    p.add_argument("--shape", choices=sorted(SHAPES) + sorted(HF_SHAPES), default="llama3-8b")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--config", help="engine YAML (default: the platform's shipped config)")
    p.add_argument("--num-blocks", type=int, default=4096, help="KV pool blocks per layer")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8", "fp8"),
                   help="KV cache storage (int8 / fp8: values + per-slot float32 scales)")
    p.add_argument("--max-buckets", type=int, default=0,
                   help="export only this many buckets, spread over the list (0: all)")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="only buckets of at most this many tokens (0: all)")
    p.add_argument("--decode-steps", type=int, default=1,
                   help="multi-step decode: the step's loop of up to K decode steps "
                        "(branched platforms: tpu)")
    p.add_argument("--tpu-chip", default="v5e", choices=("v4", "v5e", "v5p", "v6e"),
                   help="TPU generation Mosaic lowers for (default v5e)")
    p.add_argument("--tpu-kernel", default=None, choices=("v3", "tiled", "pm"),
                   help="--tpu-attention-kernel for the export (default: the config's); "
                        "pm: the KV cache is page-major")
    p.add_argument("--enable-lora", action="store_true",
                   help="the step with LoRA slot arrays in every layer and a slot per token")
    p.add_argument("--max-loras", type=int, default=4, help="adapter slots (with --enable-lora)")
    p.add_argument("--max-lora-rank", type=int, default=16,
                   help="the slots' rank (with --enable-lora)")
    p.add_argument("--quantization", default="none",
                   choices=("none", "int8", "q8_0", "q4_0", "q4_1", "q4_k"),
                   help="int8: weight-only int8 projections; q8_0 / q4_0 / q4_1 / q4_k: "
                        "GGUF blocks (embedding and head in q8_0); decode buckets must "
                        "not materialize a dequantized weight")
    p.add_argument("--quant-kernel", default="on", choices=("on", "off"),
                   help="off: the quantized matmuls on XLA's dot (the check must fail)")
    return p.parse_args(argv)


def ensure_devices(n: int) -> None:
    """Simulated CPU devices; must run before jax is imported."""
    if "jax" in sys.modules:
        return
    flag = f"--xla_force_host_platform_device_count={max(n, 1)}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pretend_tpu(chip: str) -> None:
    """Mosaic lowering reads chip facts (VMEM size, generation) from the local device;
    on a CPU host register the CPU device kind as the chosen TPU generation."""
    import jax
    try:
        from jax._src.pallas.mosaic import tpu_info
    except ImportError:
        return
    if not hasattr(tpu_info, "registry"):
        return
    version = {"v4": "TPU_V4", "v5e": "TPU_V5E", "v5p": "TPU_V5P", "v6e": "TPU_V6E"}[chip]
    info = getattr(tpu_info.ChipVersion, version, None)
    if info is not None:
        tpu_info.registry[jax.devices()[0].device_kind] = (
            lambda: tpu_info.get_tpu_info_for_chip(info, 1))


def pick_buckets(shapes: list[tuple[int, int]], limit: int) -> list[tuple[int, int]]:
    """`limit` shapes spread evenly over the list (first and last always in)."""
    if limit <= 0 or limit >= len(shapes):
        return shapes
    if limit == 1:
        return [shapes[-1]]
    idx = sorted({round(i * (len(shapes) - 1) / (limit - 1)) for i in range(limit)})
    return [shapes[i] for i in idx]


def count_kernel_calls(mlir: str, target: str, kernel: str | None = None) -> int:
    """Kernel custom calls in the module, counting calls into private functions too
    (jax lowers a jitted callee once and calls it once per layer); kernel: only the calls
    whose line holds it (a Pallas kernel's name)."""
    funcs = {m.group(1): m.start() for m in re.finditer(r"func\.func (?:private |public )?@([\w$.-]+)", mlir)}
    order = sorted(funcs.items(), key=lambda kv: kv[1])
    bodies = {name: mlir[start:(order[i + 1][1] if i + 1 < len(order) else len(mlir))]
              for i, (name, start) in enumerate(order)}
    memo: dict[str, int] = {}

    def own(body: str) -> int:
        if kernel is None:
            return body.count(f"@{target}")
        return sum(kernel in line for line in body.splitlines() if f"@{target}" in line)

    def calls_in(name: str) -> int:
        if name not in memo:
            body = bodies[name]
            memo[name] = 0     # no recursion in exported modules; guards cycles anyway
            memo[name] = own(body) + sum(
                calls_in(c) for c in re.findall(r"call @([\w$.-]+)\(", body) if c in bodies)
        return memo[name]
    return calls_in("main") if "main" in bodies else own(mlir)


def count_manual_regions(mlir: str) -> int:
    """shard_map regions in the module (Shardy or GSPMD lowering)."""
    return mlir.count("sdy.manual_computation") or mlir.count("@SPMDShardToFullShape")


class Target:
    """The engine's step for one (shape, mesh, config), with abstract inputs."""

    def __init__(self, ns: argparse.Namespace) -> None:
        import jax
        import jax.numpy as jnp
        from jaxserve.attention import kv_layout, pallas_backend
        from jaxserve.config import EngineArgs
        from jaxserve.sampling import in_step
        from jaxserve.worker.buckets import BucketSet
        from jaxserve.worker.step_programs import FusedStep
        from jaxserve.model.layers import rope_inv_freq
        from jaxserve.parallel.shard import ShardingPlan, mesh_and_rules_from_args

        self.platform = ns.platform
        self.args = EngineArgs.from_sources(ns.config or CONFIGS[ns.platform],
                                            tensor_parallel_size=ns.tp,
                                            data_parallel_size=ns.dp, step_mode="fused",
                                            attention_backend="pallas")
        self.cfg = model_config(ns.shape)
        self.quantization = getattr(ns, "quantization", "none")
        found = mesh_and_rules_from_args(self.args)
        self.plan = None
        if found is not None:     # the engine's plan; with DP, replica 0's TP group
            plan = ShardingPlan.build(self.cfg, found[0], found[1], log_summary=False)
            self.plan = plan.replicas()[0] if found[0].shape["data"] > 1 else plan
        if self.quantization != "none" and getattr(ns, "quant_kernel", "on") == "on":
            from jaxserve.model.linear import for_platform     # the engine's choice there
            self.cfg = dataclasses.replace(self.cfg, linear=for_platform(
                ns.platform, sharded=self.plan is not None,
                mesh=self.plan.mesh if self.plan is not None else None))
        self.dtype = jnp.bfloat16
        self.num_blocks, self.bs = ns.num_blocks, self.args.block_size
        self.kv_dtype = ns.kv_cache_dtype
        from jaxserve.core.engine_core import CPU_DEFAULT_MAX_MODEL_LEN
        max_len = self.args.max_model_len or min(self.cfg.max_position_embeddings,
                                                 CPU_DEFAULT_MAX_MODEL_LEN)
        self.buckets = BucketSet.build(
            max_num_batched_tokens=self.args.max_num_batched_tokens,
            max_num_seqs=self.args.max_num_seqs, max_model_len=max_len,
            block_size=self.bs, token_buckets=self.args.token_buckets or None,
            single_table_width=pallas_backend.single_table_width(ns.platform))
        self.max_len = max_len
        self.tpu_kernel = getattr(ns, "tpu_kernel", None) or self.args.tpu_attention_kernel
        self.layout = kv_layout.layout_for("pallas", ns.platform, self.tpu_kernel)
        attn = pallas_backend.make_attn_fn(platform=ns.platform, plan=self.plan,
                                           tpu_kernel=self.tpu_kernel)
        jit_kw = (self.plan.step_jit_kwargs(ns.kv_cache_dtype, self.layout)
                  if self.plan is not None else None)
        # the engine's form: branch-free sampler programs on GPU (no lax.cond)
        if ns.decode_steps > 1 and ns.platform == "cuda":
            raise SystemExit("--decode-steps: the branch-free (cuda) step has no loop")
        self.decode_steps = ns.decode_steps
        self.lora = (ns.max_loras, ns.max_lora_rank) if ns.enable_lora else None
        self.step = FusedStep(self.cfg, jnp.asarray(rope_inv_freq(self.cfg)), attn,
                              self.args.max_logprobs, lambda: None, jit_kw,
                              branch=ns.platform != "cuda", decode_steps=ns.decode_steps,
                              block_size=self.bs, num_kv_slots=self.num_blocks * self.bs)
        self._sampler_mlir: dict[Any, str] = {}
        self.in_step = in_step
        self.jax = jax

    def _abstract(self, tree: Any, shardings: Any = None) -> Any:
        """Arrays (or shape structs) -> ShapeDtypeStructs with the engine's shardings."""
        jax = self.jax
        if shardings is None:
            rep = self.plan.replicated() if self.plan is not None else None
            return jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), tree)
        return jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)

    def weights(self) -> Any:
        from jaxserve.model.params import is_spec, param_specs
        jax = self.jax
        specs = param_specs(self.cfg)
        shapes = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, self.dtype),
                                        specs, is_leaf=is_spec)
        out = self._abstract(shapes, self.plan.param_shardings() if self.plan else
                             jax.tree_util.tree_map(lambda _: None, shapes))
        if self.quantization != "none":
            from jaxserve.tools.export_quant import quantize_abstract
            out = quantize_abstract(self.cfg, out, self.dtype, self.plan, self.quantization)
        if self.lora is not None:       # the runner's LoRASlots arrays, as layer["lora"]
            from jaxserve.model import lora as lora_model
            layers = out["layers"]
            slots = jax.eval_shape(lambda: lora_model.init_slots(
                self.cfg, layers, self.lora[0] + 1, self.lora[1], self.dtype))
            for layer, entry in zip(layers, slots):
                layer["lora"] = {key: self._abstract(ab, self.plan.lora_slot_shardings(key)
                                                     if self.plan else None)
                                 for key, ab in entry.items()}
        return out

    def kv(self) -> Any:
        from jaxserve.attention import kv_layout
        c = self.cfg
        shape = self.jax.ShapeDtypeStruct(
            kv_layout.cache_shape(self.layout, c.num_kv_heads, self.num_blocks, self.bs,
                                  c.head_dim),
            self.dtype)
        sh = self.plan.kv_sharding(self.layout) if self.plan is not None else None
        one = self.jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sh)
        if self.kv_dtype != "auto":      # QuantizedKV of abstract values and scales
            from jaxserve.attention import kv_quant as quant
            sd = quant.leaf_shardings(sh, self.kv_dtype) if sh is not None else None
            one = quant.QuantizedKV(
                self.jax.ShapeDtypeStruct(shape.shape, quant.STORAGE[self.kv_dtype],
                                          sharding=sd.values if sd else None),
                self.jax.ShapeDtypeStruct(shape.shape[:3], self.jax.numpy.float32,
                                          sharding=sd.scales if sd else None))
        return [kv_layout.layer(self.layout, lambda: one) for _ in range(c.num_layers)]

    def step_inputs(self, t: int, p: int) -> tuple:
        """Abstract (packed inputs, sampler_state, key) for bucket (t, p), built the way
        the runner's warm-up builds them."""
        import numpy as np
        from jaxserve.worker.packing import Packed, pack
        from jaxserve.worker.step_inputs import StepBatch
        jax, glue = self.jax, self.in_step
        slots = self.buckets.max_num_seqs
        batch = StepBatch.dummy(t, self.buckets.rows_for(t), p, self.num_blocks, self.bs,
                                slots, full_tables=True, lora=self.lora is not None)
        rows = self.buckets.sampler_rows(batch.row_slots.shape[0])
        steps = {}
        if self.decode_steps > 1:       # (k, each row's k_r): the runner's "steps" section
            steps = dict(steps=(np.ones(1, np.int32), np.ones(rows, np.int32)))
        packed = pack(batch=(batch.tokens, batch.md),
                      sampling=glue.build_inputs(batch, {}, self.cfg.vocab_size,
                                                 num_rows=rows, pad_slot=slots), **steps)
        state = jax.eval_shape(lambda: glue.init_state(slots + 1, self.cfg.vocab_size))
        key = jax.random.PRNGKey(0)
        return (Packed(self._abstract(packed.buf), packed.layout),
                *(self._abstract(x) for x in (state, key)))

    def export(self, t: int, p: int) -> dict[str, str]:
        """The exported programs' MLIR text for bucket (t, p): {"step": ...} (branched),
        or {"forward": ..., "sampler <plan>": ...} (branch-free GPU form)."""
        from jax import export
        from kernels_pallas import export_target
        checks = [export.DisabledSafetyCheck.custom_call(n) for n in KERNEL_TARGETS.values()]
        packed, state, key = self.step_inputs(t, p)
        def run(fn: Any, *a: Any, **kw: Any) -> str:
            # CUDA: name the GPU (jax 0.11's Triton lowering asks the local one)
            target = (export_target.cuda(sharded=self.plan is not None)
                      if self.platform == "cuda" else contextlib.nullcontext())
            with target:
                return export.export(fn, platforms=[self.platform],
                                     disabled_checks=checks)(*a, **kw).mlir_module()
        if self.step.branch:
            return {"step": run(self.step._fn, self.weights(), self.kv(), packed, state, key,
                                plan=self.in_step.BRANCHED_PLAN)}
        jax, step = self.jax, self.step
        out = {"forward": run(step._fn, self.weights(), self.kv(), packed)}
        logits, sampling = jax.eval_shape(step._fn, self.weights(), self.kv(), packed)[:2]
        logits, sampling = self._abstract(logits), jax.tree_util.tree_map(self._abstract,
                                                                         sampling)
        for plan in self.in_step.all_plans(branch=False):
            name = f"sampler {plan}"
            memo = (logits.shape, plan)
            if memo not in self._sampler_mlir:
                self._sampler_mlir[memo] = run(step._sampler.fn, logits, sampling, state, key,
                                               plan=plan)
            out[name] = self._sampler_mlir[memo]
        return out


def count_conditionals(mlir: str) -> int:
    """Data-dependent conditionals (lax.cond / switch) in a module: on GPU each one is a
    device->host copy of its predicate and a stream sync."""
    return len(re.findall(r"stablehlo\.(?:case|if)\b", mlir))


def check_bucket(target: Target, t: int, p: int) -> bool:
    t0 = time.perf_counter()
    try:
        programs = target.export(t, p)
        mlir = programs.get("step") or programs["forward"]
    except Exception as e:  # report every bucket, then fail at the end
        msg = " ".join(f"{type(e).__name__}: {e}".split())[:400]
        print(f"FAIL {target.platform} tokens={t} width={p} {msg}", flush=True)
        return False
    calls = count_kernel_calls(mlir, KERNEL_TARGETS[target.platform])
    quant = ""
    if target.quantization != "none":
        verdict = check_quantized(target, t, mlir)
        calls -= verdict[0]
        if verdict[1]:
            print(f"FAIL {target.platform} tokens={t} width={p} kernel_calls={calls} "
                  f"{verdict[1]} ({time.perf_counter() - t0:.1f} s)", flush=True)
            return False
        quant = f" quant_calls={verdict[0]}"
    secs = time.perf_counter() - t0
    where = f"{target.platform} tokens={t} width={p} kernel_calls={calls}"
    if calls == 0:
        print(f"FAIL {where} (no attention kernel in the step) ({secs:.1f} s)", flush=True)
        return False
    conds = sum(count_conditionals(m) for m in programs.values())
    if target.platform == "cuda" and conds:
        print(f"FAIL {where} with {conds} conditionals (host syncs on GPU) ({secs:.1f} s)",
              flush=True)
        return False
    manual = count_manual_regions(mlir)
    if target.plan is not None and manual < calls:
        # XLA cannot partition a custom call: outside shard_map it would be gathered
        # onto every device (Triton) or refused (Mosaic)
        print(f"FAIL {where} but only {manual} shard_map regions ({secs:.1f} s)", flush=True)
        return False
    lora = ""
    if target.lora is not None:     # the slot arrays are inputs of the exported step
        S, r = target.lora[0] + 1, target.lora[1]
        d = target.cfg.hidden_size
        if f"tensor<{d}x{S}x{r}x" not in mlir:
            print(f"FAIL {where} without LoRA slot arrays [{d}, {S}, {r}] ({secs:.1f} s)",
                  flush=True)
            return False
        lora = f" lora={S - 1}x{r}"
    print(f"OK {target.platform} tokens={t} width={p} kernel_calls={calls}{lora}{quant} "
          f"({secs:.1f} s)", flush=True)
    return True


def check_quantized(target: Target, t: int, mlir: str) -> tuple[int, str]:
    """(the quantized-matmul kernel's calls, "" or what is wrong) for bucket t: in a
    decode bucket no dequantized weight outside a custom call (tools/export_quant.py)."""
    from jaxserve.model.linear import KERNEL_ROWS
    from jaxserve.tools import export_quant
    from kernels_pallas.quant_matmul import blocks, kernel
    name = kernel.KERNEL_NAME if target.quantization == "int8" else blocks.KERNEL_NAME
    n = count_kernel_calls(mlir, KERNEL_TARGETS[target.platform], name)
    if t > KERNEL_ROWS:             # prefill buckets keep XLA's dot
        return n, ""
    mesh = dict(target.plan.mesh.shape) if target.plan is not None else None
    bad = export_quant.materialized(mlir, export_quant.quantized_shapes(target.weights(), mesh, t))
    if bad:
        return n, (f"quant_calls={n}: dequantized weights outside a kernel: "
                   + ", ".join(bad[:4]) + (f" (+{len(bad) - 4} more)" if len(bad) > 4 else ""))
    if n == 0:
        return n, "quant_calls=0 (no quantized-matmul kernel in a decode bucket)"
    return n, ""


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    ensure_devices(ns.tp * ns.dp)
    import jax
    if jax.device_count() < ns.tp * ns.dp:
        print(f"FAIL {ns.platform} needs {ns.tp * ns.dp} devices, jax sees "
              f"{jax.device_count()} (set XLA_FLAGS before importing jax)")
        return 1
    if ns.platform == "tpu":
        pretend_tpu(ns.tpu_chip)
    target = Target(ns)
    shapes = pick_buckets([s for s in target.buckets.all_shapes()
                           if not ns.max_tokens or s[0] <= ns.max_tokens], ns.max_buckets)
    mesh = "1 device" if target.plan is None else f"mesh {dict(target.plan.mesh.shape)}"
    print(f"# {ns.shape} on {ns.platform} tp={ns.tp} dp={ns.dp} ({mesh}); "
          f"{len(shapes)} of {len(target.buckets.all_shapes())} buckets; "
          f"max_model_len={target.max_len} block_size={target.bs} "
          f"kv_cache={target.layout.replace('_', '-')}", flush=True)
    ok = [check_bucket(target, t, p) for t, p in shapes]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
