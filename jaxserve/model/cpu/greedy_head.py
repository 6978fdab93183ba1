"""When a greedy step finds its tokens from a float16 copy of the head (the C++ kernel in
kernels_cpu/greedy_head) instead of the float32 logits.

At batch 1 a CPU decode step is bound by the bytes it streams, and the default model's
tied head is 113 MB of the 538 MB a token reads. A row that only needs the argmax of its
logits (greedy, no logprobs, no penalty, bias, suppressed stop ids or token mask) gets it
from a pass over a float16 copy of the head plus the float32 panels that can hold the
maximum, which the kernel proves with a per-entry bound: the token is the one the float32
logits' argmax picks, bit for bit (kernels_cpu/greedy_head/head.cc says why). The batch-1
head reads about half the bytes (docs/benchmarks.md, "Greedy head").

Two decisions, one per time:
- engine start (`add_screen`, by the runner, `--greedy-head auto` with the CPU matmul
  kernel on): a head stored as packed panels (model/cpu/matmul.py: the tied head's copy
  or an untied lm_head) gets "head_screen": its float16 copy (V x D x 2 bytes more
  memory) and the bound of each vocabulary entry. A head whose weights do not fit
  float16 gets none.
- trace time (`usable`): the step has at most SMALL_STEP_TOKENS logit rows (the decode
  buckets, where the head's bytes matter) and no final soft cap (tanh can round two distinct
  logits to one value, which the bound does not cover). Whether the step's rows all
  only need the argmax is a device-side flag (in_step.plain_greedy): a lax.cond
  picks this path or the full head and sampler per step.
"""
from __future__ import annotations

import logging
from typing import Any

from flax import struct
import jax

from jaxserve.model.config import ModelConfig
from jaxserve.model.cpu import SMALL_STEP_TOKENS
from jaxserve.model.cpu.matmul import PackedWeight

SETTINGS = ("auto", "off")
log = logging.getLogger("jaxserve")


# eq/repr off: weights compare and hash by identity and never print their arrays
@struct.dataclass(eq=False, repr=False)
class ScreenedHead:
    """The head's screen for kernels_cpu/greedy_head/kernel.py."""
    panels16: Any   # [V / 32, D, 32] float16 the head's copy, as the packed panels
    bound: Any      # [V] float32 each vocabulary entry's bound


def head_weight(weights: dict[str, Any]) -> PackedWeight | None:
    """The packed head compute_logits reads (model/decoder.py), or None."""
    w = weights.get("head_packed", weights.get("lm_head"))
    return w if isinstance(w, PackedWeight) else None


def add_screen(weights: dict[str, Any], setting: str = "auto") -> dict[str, Any]:
    """weights with "head_screen" added when the setting is auto and the packed head fits
    float16 (the caller's dict is not changed)."""
    if setting not in SETTINGS:
        raise ValueError(f"greedy_head must be one of {SETTINGS}, not {setting!r}")
    w = head_weight(weights)
    if setting == "off" or w is None:
        return weights
    from kernels_cpu.greedy_head.kernel import screen_copy
    got = screen_copy(w.panels)
    if got is None:
        log.info("greedy head: off (a head weight is beyond float16's range)")
        return weights
    log.info("greedy head: greedy rows of steps of <= %d rows read a float16 copy of the "
             "head (%d MB) and recheck the candidates in float32", SMALL_STEP_TOKENS,
             got[0].nbytes >> 20)
    return {**weights, "head_screen": ScreenedHead(*got)}


def usable(weights: dict[str, Any], cfg: ModelConfig, rows: int) -> bool:
    """Trace-time check (see the module doc)."""
    return ("head_screen" in weights and head_weight(weights) is not None
            and rows <= SMALL_STEP_TOKENS and cfg.final_logit_softcap is None)


def greedy_ids(weights: dict[str, Any], h: jax.Array) -> jax.Array:
    """h [R, D] (final-normed) -> [R] int32, the argmax of each row's float32 logits."""
    from kernels_cpu.greedy_head.kernel import greedy_head
    screen, w = weights["head_screen"], head_weight(weights)
    assert w is not None
    return greedy_head(h.astype(w.dtype), screen.panels16, screen.bound, w.panels)
