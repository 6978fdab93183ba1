"""P/D parity on the default model (SmolLM2-135M-Instruct): a prefill and a decode
server behind `router --policy pd` give the same greedy text as one co-located server,
chat and completions, streamed and not; the KV really moved (the decode server's pull
counters) and every block is free afterwards on both sides."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest


from pd_harness import PDCluster  # noqa: E402
from server_harness import MODEL_NAME, wait_kv_free  # noqa: E402

MESSAGES = [[{"role": "user", "content": "Name three rivers in Europe and say where each "
                                          "one reaches the sea."}],
            [{"role": "system", "content": "You answer in one short sentence."},
             {"role": "user", "content": "Why is the sky blue during the day?"}]]


@pytest.fixture(scope="module")
def cluster(default_model):
    from jaxserve.config import EngineArgs
    m = default_model

    def args(kv_transfer_config: str | None) -> EngineArgs:
        return EngineArgs(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                          token_buckets=[64], block_size=16, num_kv_blocks=64,
                          served_model_name=MODEL_NAME, port=0, enable_admin_routes=True,
                          kv_transfer_config=kv_transfer_config)
    c = PDCluster.start((m.config, m.weights, m.tokenizer), args,
                        json.dumps({"kv_role": "kv_producer"}),
                        json.dumps({"kv_role": "kv_consumer"}), warmup=False)
    yield c
    c.close()


def _chat(url: str, messages: list, stream: bool) -> str:
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 24, "temperature": 0,
            "stream": stream}
    if not stream:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        events = [json.loads(ln[6:]) for ln in r.iter_lines()
                  if ln.startswith("data: ") and ln != "data: [DONE]"]
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if e["choices"])


def _complete(url: str, prompt: str) -> str:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _all_at_once(calls: list) -> list:
    """Every request in flight together. Each server pads every step to its one 64-token
    bucket, so a step costs the same with one sequence or four: sent together, the
    requests share their steps instead of each paying for its own. Greedy rows do not
    depend on what else is in the step (same shapes, row-wise kernels), so the texts are
    what each request alone would get."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call[0](*call[1:]), calls))


def test_smollm_pd_matches_colocated(cluster):
    colo, pre, dec, router = cluster
    stats = dec.engine.core.kv_connector.stats
    prompt = "The history of the printing press begins"
    *want, want_text = _all_at_once([(_chat, colo.url, m, False) for m in MESSAGES] +
                                    [(_complete, colo.url, prompt)])
    assert all(len(w) > 20 for w in want) and want_text
    got = _all_at_once([(_chat, router.url, m, stream) for m in MESSAGES
                        for stream in (False, True)] + [(_complete, router.url, prompt)])
    assert got == [w for w in want for _ in (False, True)] + [want_text]
    assert stats.load_failures == 0 and stats.loads >= 3, stats
    for s in (pre, dec):
        kv = wait_kv_free(s.url)
        assert kv["num_free_blocks"] == kv["num_blocks"]
