"""What a tiny test engine's fused step costs to compile, whole or with one part of the
sampler taken out: the CPU seconds (this process) to trace, lower and compile the step
for the engine's first four token buckets, with the suite's XLA flags and no persistent
cache. A measuring tool for the suite's compile time (docs/benchmarks.md, "Test
suite"); the parts taken out are monkeypatched away, so its programs are not the
engine's, and nothing here is a test.

    PYTHONPATH=tests/support .venv/bin/python tests/support/step_compile_cost.py \\
        [none|sampler|mask|truncation|penalties|greedy-head|draw|logprobs|vocab-draw]

Run each variant in its own process (the patches stay for the process's life), and
alternate them: one run is a few seconds and the machine's noise is a few tenths.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
import conftest  # noqa: E402,F401 - the suite's XLA flags, set before jax starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from engine_pool import tiny_model  # noqa: E402
from jaxserve.frontend.llm import LLM  # noqa: E402
from jaxserve.sampling import in_step, sampler, truncation  # noqa: E402
from jaxserve.sampling.sampler import SamplerOutput  # noqa: E402
from jaxserve.worker import step_programs  # noqa: E402


def _argmax_only(logits: Callable[[], Any], inputs: Any, state: Any, key: Any, n: int,
                 plan: Any, ids: Any = None) -> tuple[SamplerOutput, Any]:
    """The step's sampling stage with nothing but an argmax of the logits."""
    tokens = jnp.argmax(logits(), -1).astype(jnp.int32)
    return in_step.greedy_choice(tokens, inputs, num_logprobs=n)[0], state


def _no_logprobs(lg: Any, tokens: Any, n: int) -> tuple[Any, Any, Any]:
    R = lg.shape[0]
    return (jnp.zeros((R, n + 1)), jnp.zeros((R, n + 1), jnp.int32),
            jnp.zeros((R,), jnp.int32))


def _take_out(part: str) -> None:
    if part == "sampler":
        step_programs._sample = _argmax_only
    elif part == "mask":            # no token-mask cond: the sampler on the raw logits
        in_step.mask_logits = lambda lg, words, branch=True: lg
    elif part == "truncation":
        sampler.truncate = lambda x, md, is_random, **kw: truncation.no_cut(*x.shape)
    elif part == "penalties":
        sampler.apply_penalties = lambda logits, *a, **kw: logits
    elif part == "greedy-head":
        from jaxserve.model.cpu import greedy_head
        greedy_head.usable = lambda *a: False
    elif part == "draw":
        sampler.row_uniforms = lambda md, key: jnp.zeros((md.num_rows,), jnp.float32)
    elif part == "logprobs":
        in_step.compute_logprobs = _no_logprobs
    elif part == "vocab-draw":
        sampler._draw_vocab = lambda x, threshold, u: jnp.zeros((x.shape[0],), jnp.int32)
    elif part != "none":
        raise SystemExit(f"unknown part {part!r}")


def main() -> None:
    part = sys.argv[1] if len(sys.argv) > 1 else "none"
    jax.config.update("jax_enable_compilation_cache", False)
    conftest._small_cpu_kv_default()
    _take_out(part)
    cfg, weights, tok = tiny_model()
    llm = LLM.from_weights(cfg, weights, tok, warmup=False, step_mode="fused")
    runner = llm.engine.runner
    shapes = runner.buckets.all_shapes()[:4]
    t0 = time.process_time()
    for tokens, width in shapes:
        runner._compile_shape(tokens, width)
    print(f"{part}: {len(shapes)} step shapes {[t for t, _ in shapes]} compiled in "
          f"{time.process_time() - t0:.2f} CPU-s")


if __name__ == "__main__":
    main()
