"""Servers shared by several modules of the server tier (one engine build each for the
whole session instead of one per module)."""
from __future__ import annotations

from typing import Any, Iterator

import pytest

from server_harness import ALIAS, MODEL_NAME, ServerThread, tiny_args, tiny_parts


@pytest.fixture(scope="session")
def api_server() -> Iterator[Any]:
    """The tiny model behind the full HTTP API (warmed up), serving MODEL_NAME and ALIAS;
    tests/server/test_server_api.py and test_responses_api.py share it."""
    from jaxserve.server.launch import build_engine
    cfg, weights, tok = tiny_parts()
    args = tiny_args(served_model_name=[MODEL_NAME, ALIAS])
    engine = build_engine(args, cfg, weights, tok, warmup=True)
    srv = ServerThread(engine, tok, args)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def smollm_server(default_model: Any) -> Iterator[Any]:
    """SmolLM2-135M-Instruct (a real tokenizer: JSON, tool calls) behind the HTTP API,
    warmed up; `compiles_after_warmup` is its compile count then. The 64-token bucket
    keeps a short chat prompt's prefill from padding to 256 tokens: on a slow CPU that
    step alone nears the 2 s gap the hostile-constraint tests allow a victim stream.
    tests/server/test_structured_outputs_http.py and test_responses_smollm.py share it."""
    from jaxserve.config import EngineArgs
    from jaxserve.server.launch import build_engine
    m = default_model
    args = EngineArgs(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256,
                      token_buckets=[16, 64, 256], block_size=16, num_kv_blocks=256,
                      served_model_name=MODEL_NAME, port=0)
    srv = ServerThread(build_engine(args, m.config, m.weights, m.tokenizer, warmup=True),
                       m.tokenizer, args)
    srv.compiles_after_warmup = srv.engine.core.num_compiles
    yield srv
    srv.stop()
