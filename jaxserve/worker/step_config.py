"""StepConfig: every choice about how a step runs, made once at engine start.

The scheduler and the runner read it and decide nothing of their own: which program
form runs a bucket (fused, layerwise, hybrid), how many layers one layerwise call runs,
whether and for which batches decode steps run back to back on the device, the greedy
head, whether the sampler branches on data, and the order in which the host dispatches
and collects steps. `resolve_step_config` is the only place these are decided; the
result is logged as one block.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

import jax

from jaxserve.config import EngineArgs
from jaxserve.model.cpu import SMALL_STEP_TOKENS
from jaxserve.parallel.shard import spans_devices
from jaxserve.worker.buckets import BucketSet

log = logging.getLogger("jaxserve")

StepForm = Literal["fused", "layerwise", "hybrid"]
HostOrder = Literal["async", "pipelined", "in_turn"]


@dataclass(frozen=True, slots=True)
class StepConfig:
    form: StepForm
    num_layers: int
    # layers one layerwise call runs; 0: all of them for small steps, one above
    layers_per_call: int
    # most decode steps one step runs on the device (1: multi-step decode off)
    decode_steps: int
    # the largest token bucket that carries the multi-step loop (0: none)
    multi_step_bucket: int
    # the largest batch (requests) a multi-step step may have (0: multi-step off)
    multi_step_rows: int
    multi_step_streams: bool
    greedy_head: str                # "auto" | "off" (model/cpu/greedy_head.py)
    # lax.cond on data: a host round trip on GPU, where branch-free programs run instead
    sampler_branches: bool
    host_order: HostOrder
    # steps of more tokens than this are waited for inside dispatch (None: never)
    block_dispatch_above: int | None
    small_step_tokens: int = SMALL_STEP_TOKENS
    # why a requested choice was turned off, for the start-up log
    notes: tuple[str, ...] = field(default=(), compare=False)

    def layers_for(self, tokens: int) -> int:
        """Layers one layerwise call runs in a bucket of `tokens` tokens. Auto: all of
        them for small steps (there the ~30 program boundaries cost ~20% of a batch-1
        step on CPU), one above (compute dominates; each grouped bucket costs ~3.4 s
        more to compile cold)."""
        if self.layers_per_call:
            return self.layers_per_call
        return self.num_layers if tokens <= self.small_step_tokens else 1

    def fused_for(self, tokens: int) -> bool:
        """Whether a bucket of `tokens` tokens runs the fused program."""
        if self.form == "hybrid":
            return tokens <= self.small_step_tokens
        return self.form == "fused"

    def describe(self, token_buckets: tuple[int, ...] | list[int]) -> str:
        """The start-up log block (one record, several lines)."""
        fused = [t for t in token_buckets if self.fused_for(t)]
        layerwise = [f"{t}:{self.layers_for(t)}" for t in token_buckets
                     if not self.fused_for(t)]
        multi = (f"up to {self.decode_steps} steps for batches of <= "
                 f"{self.multi_step_rows} requests"
                 + ("" if self.multi_step_streams else " that do not stream")
                 if self.decode_steps > 1 else "off")
        lines = [
            f"step config: {self.form} step, small steps <= {self.small_step_tokens} tokens",
            f"  fused buckets: {', '.join(map(str, fused)) or 'none'}",
            f"  layerwise buckets (tokens:layers per call): {', '.join(layerwise) or 'none'}",
            f"  multi-step decode: {multi}",
            f"  sampler: {'branched' if self.sampler_branches else 'branch-free'}, "
            f"greedy head setting: {self.greedy_head}",
            f"  host order: {self.host_order}, dispatch blocks for steps of > "
            + ("never" if self.block_dispatch_above is None
               else f"{self.block_dispatch_above} tokens"),
        ]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def step_platform(plan: Any) -> str:
    """The platform the step runs on ("cpu", "gpu", "tpu")."""
    dev = plan.mesh.devices.flat[0] if plan is not None else jax.devices()[0]
    return "gpu" if dev.platform in ("gpu", "cuda", "rocm") else dev.platform


def resolve_step_config(args: EngineArgs, *, num_layers: int, buckets: BucketSet,
                        plan: Any, speculative: bool) -> StepConfig:
    """Every step choice from the args, the platform and the sharding plan (logged)."""
    notes: list[str] = []
    backend, platform = jax.default_backend(), step_platform(plan)
    form = _step_form(args, backend)
    branches = platform != "gpu"
    decode_steps = _decode_steps(args, plan, speculative, backend, notes)
    if decode_steps > 1 and (form == "layerwise" or not branches):
        notes.append(f"multi-step decode off: it needs the fused step with the branched "
                     f"sampler (not {form} step / "
                     f"{'branched' if branches else 'branch-free'})")
        decode_steps = 1
    multi_bucket = max((t for t in buckets.token_buckets if t <= SMALL_STEP_TOKENS),
                       default=0)
    if decode_steps > 1 and not multi_bucket:
        notes.append(f"multi-step decode off: no token bucket of <= {SMALL_STEP_TOKENS} "
                     "tokens")
        decode_steps = 1
    cfg = StepConfig(
        form=form, num_layers=num_layers, layers_per_call=args.layers_per_call,
        decode_steps=decode_steps, multi_step_bucket=multi_bucket,
        multi_step_rows=min(multi_bucket, buckets.max_num_seqs) if decode_steps > 1 else 0,
        multi_step_streams=args.multi_step_streams, greedy_head=args.greedy_head,
        sampler_branches=branches, host_order=_host_order(args, plan, form, notes),
        block_dispatch_above=_block_dispatch_above(platform, form),
        notes=tuple(notes))
    log.info("%s", cfg.describe(buckets.token_buckets))
    return cfg


def _step_form(args: EngineArgs, backend: str) -> StepForm:
    if args.step_mode != "auto":
        return args.step_mode       # type: ignore[return-value]
    # CPU: fused programs for the small (decode) buckets, where a step is a few ms and
    # the layerwise step's extra launches cost 1.1-1.2x at batch 1; layerwise above,
    # where a fused bucket would cost compile time (docs/benchmarks.md)
    return "hybrid" if backend == "cpu" else "fused"


def _decode_steps(args: EngineArgs, plan: Any, speculative: bool, backend: str,
                  notes: list[str]) -> int:
    """--decode-steps; auto (0): 4 on CPU for one host and one device, where it was
    measured (docs/benchmarks.md, "Multi-step decode"), else 1 (under a plan that splits
    the step, the loop in every fused program costs compile time: 3-4x on the
    eight-device test suites). Speculative decoding turns it off: a drafter's KV follows
    the target's one step at a time."""
    if speculative:
        if args.decode_steps > 1:
            notes.append("multi-step decode off: speculative decoding is on")
        return 1
    if args.decode_steps:
        return args.decode_steps
    return 4 if (backend == "cpu" and args.num_hosts <= 1
                 and not spans_devices(plan)) else 1


def _host_order(args: EngineArgs, plan: Any, form: StepForm,
                notes: list[str]) -> HostOrder:
    """Multi-host runs and the layerwise step under a sharding plan keep the pipelined
    order: with async steps `jaxserve serve` across two processes hung, and the sharded
    layerwise step aborted inside XLA:CPU (8 simulated devices, TP >= 2); both not yet
    understood (README). The fused step under a plan is tested async, and so is a
    one-device plan (a data-parallel replica at TP=1: nothing is split)."""
    if not args.pipeline_steps:
        return "in_turn"
    if not args.async_scheduling:
        return "pipelined"
    if args.num_hosts > 1 or (spans_devices(plan) and form != "fused"):
        notes.append("asynchronous scheduling off for this engine ("
                     + ("multi-host" if args.num_hosts > 1 else "sharded layerwise step")
                     + "); pipelined steps")
        return "pipelined"
    return "async"


def _block_dispatch_above(platform: str, form: StepForm) -> int | None:
    """On XLA:CPU a layerwise step is launched one layer call at a time, each waiting for
    the step before to release that layer's donated cache: launched behind a running
    step, the host thread woke ~30 times during it on the cores that ran it, and the
    shared offline workload (mostly such steps) ran 5-10% slower on 2 cores than in turn
    (docs/benchmarks.md, "Big CPU steps in turn"). Fused steps (one launch) stay
    pipelined / asynchronous."""
    if platform != "cpu" or form == "fused":
        return None
    return SMALL_STEP_TOKENS if form == "hybrid" else 0
