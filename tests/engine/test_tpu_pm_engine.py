"""The engine with --tpu-attention-kernel pm on CPU: the KV cache is allocated
page-major (attention/kv_layout.py) and the page-major TPU kernel runs in the TPU
interpreter, fused KV write included; greedy tokens equal the default backend's.
Features that copy head-major KV blocks refuse the flag at start-up."""
from __future__ import annotations

import pytest

from jaxserve.attention import kv_layout
from jaxserve.config import ConfigError, EngineArgs
from engine_utils import core_greedy

ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
              token_buckets=[16], num_kv_blocks=10, block_size=8)




def _engine(cfg, weights, **kw):
    from jaxserve.core.engine_core import EngineCore
    return EngineCore(EngineArgs(**{**ENGINE, **kw}), cfg, weights, progress=False)


# one token bucket: each compiled shape runs the TPU interpreter's tracing (~10 s)
@pytest.mark.parametrize("kind", ["auto", pytest.param("int8", marks=pytest.mark.slow)])
def test_engine_with_page_major_cache_matches_default_backend(kind):
    from engine_utils import random_prompts, tiny_config, tiny_weights
    from jaxserve.attention import kv_quant
    cfg = tiny_config()
    weights = tiny_weights(cfg)
    # a prompt longer than one step's tokens (chunked prefill), decodes across blocks
    prompts = random_prompts(3, cfg.vocab_size, 3, 20, seed=5)
    want = core_greedy(_engine(cfg, weights, kv_cache_dtype=kind), prompts, 6)
    eng = _engine(cfg, weights, attention_backend="pallas", tpu_attention_kernel="pm",
                  step_mode="fused", kv_cache_dtype=kind)
    assert eng.backend.kv_layout == kv_layout.PAGE_MAJOR
    kv, none = eng.runner.kv[0]
    assert none is None and kv.shape == (10, 2 * cfg.num_kv_heads, 8, cfg.head_dim)
    assert kv_quant.is_quantized(kv) == (kind == "int8")
    assert core_greedy(eng, prompts, 6) == want


@pytest.mark.parametrize("kw", [
    dict(kv_offload_bytes=1 << 20),
    dict(speculative_config={"method": "self", "draft_num_layers": 1,
                             "num_speculative_tokens": 2}),
    dict(kv_transfer_config='{"kv_role": "kv_producer"}'),
])
def test_features_that_copy_head_major_blocks_refuse_pm(kw):
    with pytest.raises(ConfigError, match="tpu_attention_kernel pm"):
        EngineArgs(tpu_attention_kernel="pm", **kw)
    EngineArgs(tpu_attention_kernel="v3", **kw)     # the default layout takes them


def test_layout_follows_backend_platform_and_kernel():
    assert kv_layout.layout_for("pallas", "tpu", "pm") == kv_layout.PAGE_MAJOR
    assert kv_layout.layout_for("pallas", "cpu", "pm") == kv_layout.PAGE_MAJOR
    assert kv_layout.layout_for("pallas", "cuda", "pm") == kv_layout.HEAD_MAJOR
    assert kv_layout.layout_for("cpu", "cpu", "pm") == kv_layout.HEAD_MAJOR
    assert kv_layout.layout_for("pallas", "tpu", "v3") == kv_layout.HEAD_MAJOR
    with pytest.raises(ValueError):
        kv_layout.layout_for("pallas", "tpu", "v4")
