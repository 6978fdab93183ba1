"""P/D with the KV sent as int8 (`wire_dtype: int8`, kv_transfer/wire.py) over real HTTP
on 127.0.0.1: the decode server pulls every prompt's KV in int8 (tests/unit/test_kv_transfer_
wire.py shows on the same stream that int8 data, not the exact bytes, arrives) and its
greedy completions stay close to a co-located server's: this random tiny model is
chaotic, so rounding noise in the prompt's KV flips some tokens, and the bar is the one
tests/engine/test_kv_cache_quant.py sets for the int8 KV cache (same granularity): most first
tokens equal, a mean common prefix of at least half. KV that arrived broken (wrong
layout, wrong scales) agrees with nothing. Every block is free on both sides afterwards.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest


from pd_harness import PDCluster, settled  # noqa: E402
from server_harness import tiny_args, tiny_parts  # noqa: E402

PRODUCER = json.dumps({"kv_role": "kv_producer", "chunk_blocks": 2, "ttl": 5})
CONSUMER = json.dumps({"kv_role": "kv_consumer", "chunk_blocks": 2, "timeout": 10,
                       "wire_dtype": "int8"})
BASE = [(7 * i) % 120 + 3 for i in range(120)]
PROMPTS = [" ".join(f"w{i}" for i in BASE[a:b]) for a, b in
           ((0, 20), (0, 33), (5, 60), (7, 117), (3, 40), (10, 29), (1, 60), (20, 100))]


@pytest.fixture(scope="module")
def cluster():
    c = PDCluster.start(tiny_parts(), tiny_args, PRODUCER, CONSUMER)
    yield c
    c.close()


def _text(url: str, prompt: str) -> str:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": 8,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_int8_wire_greedy_close_to_colocated(cluster):
    colo, pre, dec, router = cluster
    conn = dec.engine.core.kv_connector
    assert conn.cfg.wire_dtype == "int8"
    stats = conn.stats
    agree = []
    for prompt in PROMPTS:
        got, want = _text(router.url, prompt).split(), _text(colo.url, prompt).split()
        agree.append(next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                          len(want)))
    assert np.mean([a > 0 for a in agree]) >= 0.7, agree          # first tokens
    assert np.mean(agree) >= 4, agree                             # of 8
    assert stats.load_failures == 0, stats.failures
    assert stats.loads == len(PROMPTS) and stats.blocks_loaded > 0
    settled(pre, dec)
