"""Engine section of jaxserve/tools/device_check.py: the engine's fused step at Llama-3-8B shapes.

An EngineCore is built from the shipped H200 config (fused step, Pallas attention,
bf16) with random weights made on the device, and its ModelRunner is driven with
SchedulerOutputs such as the scheduler emits for requests whose long prompts are
already cached (prefix hits): the first step computes each prompt's last token, the
next ones decode. So a 64 x 2k decode batch runs without a 131k-token prefill, and the
step measured is exactly the engine's (batch building, packing, launch, sampling).

Per batch: the first step's time (trace + compile + run), the steady step time
(median), its MBU (weights + KV read per step over peak bandwidth), host dispatch
time vs device time, and the compilations counted after the first steps (should be 0).
"""
from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np

from .device_check_run import FULL_DECODE, ROOT, SMOKE_DECODE, Run, guarded

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                 num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                 rope_theta=500000.0, max_position_embeddings=8192,
                 rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0),
                               ("low_freq_factor", 1.0),
                               ("original_max_position_embeddings", 8192),
                               ("rope_type", "llama3")))
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, max_position_embeddings=128)
H200_CONFIG = ROOT / "configs" / "gpu_h200_llama3-8b.yaml"
WARM_STEPS = 2            # not timed: the first compiles, the second may finish warming


def model_config(smoke: bool, layers: int | None) -> Any:
    from jaxserve.model.config import ModelConfig
    shape = dict(TINY if smoke else LLAMA3_8B)
    if layers:
        shape["num_layers"] = layers
    return ModelConfig(architecture="LlamaForCausalLM", family="llama", **shape)


def random_weights(cfg: Any, dtype: Any) -> Any:
    """The weights pytree, drawn on the device (8B host-side randoms would take minutes)."""
    import jax
    import jax.numpy as jnp
    from jaxserve.model.params import is_spec, param_specs

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def make(key, shape, init):
        if init == "ones":
            return jnp.ones(shape, dtype)
        if init == "zeros":
            return jnp.zeros(shape, dtype)
        return (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(dtype)

    specs, treedef = jax.tree_util.tree_flatten(param_specs(cfg), is_leaf=is_spec)
    key = jax.random.PRNGKey(0)
    leaves = [make(jax.random.fold_in(key, i), s.shape, s.init) for i, s in enumerate(specs)]
    return jax.block_until_ready(jax.tree_util.tree_unflatten(treedef, leaves))


def engine_args(smoke: bool, num_blocks: int) -> Any:
    from jaxserve.config import EngineArgs
    common = dict(step_mode="fused", attention_backend="pallas", num_kv_blocks=num_blocks,
                  enable_prefix_caching=False)
    if smoke:
        # XLA's dot, as on an accelerator: the CPU matmul kernel (a C++ library built on
        # first use) is not what the check is about, and its build was most of a smoke
        # run on a fresh machine
        return EngineArgs(dtype="float32", max_model_len=64, block_size=8, max_num_seqs=4,
                          max_num_batched_tokens=8, token_buckets=[4],
                          cpu_matmul_kernel="off", **common)
    return EngineArgs.from_sources(str(H200_CONFIG), **common)


class Driver:
    """Feeds one ModelRunner hand-made SchedulerOutputs for batches of cached prompts."""

    def __init__(self, runner: Any, vocab: int, block_size: int) -> None:
        self.runner, self.vocab, self.bs = runner, vocab, block_size
        self.live: list[str] = []
        self.n = 0

    def start(self, batch: int, prompt_len: int, max_seq: int) -> Any:
        """A step for `batch` new requests with prompt_len - 1 tokens cached (one to
        compute each), and blocks for max_seq tokens; drops the previous batch."""
        from jaxserve.sampling.params import SamplingParams
        from jaxserve.core.sched.output import NewRequestData, SchedulerOutput
        pages = -(-max_seq // self.bs)
        rng = np.random.default_rng(self.n)
        params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
        new = []
        for r in range(batch):
            self.n += 1
            tokens = rng.integers(0, self.vocab, prompt_len).tolist()
            blocks = list(range(1 + r * pages, 1 + (r + 1) * pages))
            new.append(NewRequestData(f"r{self.n}", tokens, prompt_len, params, blocks,
                                      prompt_len - 1))
        finished, self.live = set(self.live), [n.req_id for n in new]
        return SchedulerOutput(new, [], {n.req_id: 1 for n in new}, batch,
                               finished_req_ids=finished)

    def decode(self, computed: int) -> Any:
        """One decode token for every live request; `computed` tokens are in the cache."""
        from jaxserve.core.sched.output import CachedRequestData, SchedulerOutput
        cached = [CachedRequestData(rid, [], computed) for rid in self.live]
        return SchedulerOutput([], cached, {rid: 1 for rid in self.live}, len(self.live))

    def step(self, so: Any) -> dict:
        t0 = time.perf_counter()
        inflight = self.runner.dispatch(so)
        t1 = time.perf_counter()
        res = self.runner.collect(inflight)
        t2 = time.perf_counter()
        return {"step": t2 - t0, "dispatch": t1 - t0,
                "device": getattr(res, "device_seconds", float("nan")),
                "host": getattr(res, "host_seconds", float("nan")),
                "sampled": len(getattr(res, "sampled", {}))}


def bytes_per_step(cfg: Any, weights: Any, batch: int, seq: int, itemsize: int) -> int:
    """HBM bytes one decode step must read: every weight once (the embedding table only
    when it doubles as the head) and each row's K and V in every layer."""
    import jax
    w = sum(x.nbytes for x in jax.tree_util.tree_leaves(weights))
    if not cfg.tie_word_embeddings:
        w -= weights["embed"].nbytes                 # gathered rows only
    kv = batch * seq * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * itemsize
    return int(w + kv)


def run_batch(run: Run, drv: Driver, cfg: Any, weights: Any, batch: int, target: int,
              steps: int) -> dict:
    """First step (compile) + warm-up + `steps` timed decode steps ending at seq `target`."""
    prompt_len = target - (WARM_STEPS - 1 + steps)
    t = drv.step(drv.start(batch, prompt_len, target))
    first = t["step"]
    for i in range(1, WARM_STEPS):
        drv.step(drv.decode(prompt_len + i - 1))
    compiles0 = drv.runner.num_compiles
    timed = [drv.step(drv.decode(prompt_len + WARM_STEPS - 1 + i)) for i in range(steps)]
    med = {k: float(np.median([s[k] for s in timed])) for k in ("step", "dispatch", "device",
                                                                 "host")}
    itemsize = np.dtype(run.dtype).itemsize
    nbytes = bytes_per_step(cfg, weights, batch, target, itemsize)
    bucket = drv.runner.buckets.pick(batch, -(-target // drv.bs))
    return {"ok": all(s["sampled"] == batch for s in timed), "bucket": f"{bucket}",
            "step_ms": med["step"] * 1e3, "dispatch_ms": med["dispatch"] * 1e3,
            "device_ms": med["device"] * 1e3, "host_ms": med["host"] * 1e3,
            "first_step_s": first, "compile_s": first - med["step"],
            "recompiles": drv.runner.num_compiles - compiles0,
            "mbu": run.mbu(nbytes, med["step"]), "bytes_per_step": nbytes,
            "tok_per_s": batch / med["step"], "steps": steps}


def engine_section(run: Run, layers: int | None = None, steps: int | None = None) -> None:
    steps = steps or (3 if run.smoke else 20)
    workloads = SMOKE_DECODE if run.smoke else FULL_DECODE
    box: dict[str, Any] = {}

    def build() -> dict:
        from jaxserve.core.engine_core import EngineCore
        cfg = model_config(run.smoke, layers)
        bs = 8 if run.smoke else 16
        blocks = max(b * -(-c // bs) for _, b, c in workloads) + 2
        t0 = time.perf_counter()
        weights = random_weights(cfg, run.dtype)
        t1 = time.perf_counter()
        core = EngineCore(engine_args(run.smoke, blocks), cfg, weights, warmup=False,
                          progress=False)
        box.update(cfg=cfg, weights=core.runner.weights,
                   driver=Driver(core.runner, cfg.vocab_size, bs), core=core)
        return {"ok": True, "weights_s": t1 - t0, "engine_s": time.perf_counter() - t1,
                "layers": cfg.num_layers, "kv_blocks": blocks,
                "weight_gb": sum(x.nbytes for x in _leaves(weights)) / 1e9,
                "attention": core.backend.name}
    guarded(run, "engine_setup", "setup", 40 if not run.smoke else 5,
            lambda: run.bounded("engine setup", build))
    if "driver" not in box:
        return
    for name, batch, ctx in workloads:
        # bounded: a batch that cannot finish (its first step compiles the 8B step, 30-90
        # s) before the deadline is abandoned; the runner is then busy, so the section ends
        guarded(run, "engine", name, 45 if not run.smoke else 5,
                lambda b=batch, c=ctx, n=name: run.bounded(
                    f"engine {n}", lambda: run_batch(run, box["driver"], box["cfg"],
                                                     box["weights"], b, c, steps)))
        if run.results["engine"][-1].get("skipped"):
            break


def _leaves(tree: Any) -> list:
    import jax
    return jax.tree_util.tree_leaves(tree)
