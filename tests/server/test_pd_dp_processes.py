"""Data-parallel replica processes as KV producers and consumers:
`jaxserve serve --data-parallel-size 2 --data-parallel-backend processes
--kv-transfer-config '{"kv_role": "kv_both"}'` on 127.0.0.1, with one-engine servers of
the same checkpoint beside it: a co-located reference and a kv_both server.

* a prefill answered by either replica advertises that replica's own transfer endpoint
  (two replicas, two ports), and a decode server pulls from it without a failure;
* `router --policy pd` with the DP server prefilling and the one-engine server decoding,
  and the other way round (the DP server's replicas pull), gives the co-located greedy
  text, streamed and not; the KV really moved both ways and every block is free after.

The unit side (each replica's --kv-transfer-config, the refusals) runs without
processes at the top.
"""
from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import httpx
import pytest


from jaxserve.config import ConfigError, EngineArgs  # noqa: E402
from jaxserve.router.dp_processes import check_kv_transfer, child_argv, child_kv_config  # noqa: E402
from pd_harness import pd_router  # noqa: E402
from router_harness import wait  # noqa: E402
from server_harness import (SMALL, ServerThread, save_tiny_checkpoint, spawn_dp_server,  # noqa: E402
                            tiny_args, wait_kv_free)

KV_BOTH = {"kv_role": "kv_both", "chunk_blocks": 2, "ttl": 10, "timeout": 10}


def test_each_replica_gets_its_own_transfer_endpoint():
    args = EngineArgs(data_parallel_size=3, data_parallel_backend="processes",
                      host="10.0.0.5", kv_transfer_config=json.dumps(
                          {"kv_role": "kv_producer", "kv_port": 14579, "ttl": 5}))
    cfgs = [json.loads(child_kv_config(args, i)) for i in range(3)]
    assert [c["kv_port"] for c in cfgs] == [14579, 14580, 14581]
    assert {c["kv_ip"] for c in cfgs} == {"10.0.0.5"}   # the parent's address, not 127.0.0.1
    assert all(c["ttl"] == 5 and c["kv_role"] == "kv_producer" for c in cfgs)
    argv = child_argv(args, 1234, 2)
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1]) == cfgs[2]
    any_port = args.replace(kv_transfer_config='{"kv_role": "kv_consumer"}')
    assert json.loads(child_kv_config(any_port, 1)) == {"kv_role": "kv_consumer"}
    explicit = args.replace(kv_transfer_config='{"kv_role": "kv_both", "kv_ip": "10.1.1.1"}')
    assert json.loads(child_kv_config(explicit, 1))["kv_ip"] == "10.1.1.1"


def test_refusals_at_start_up():
    with pytest.raises(ConfigError, match="data_parallel_backend processes"):
        EngineArgs(kv_transfer_config='{"kv_role": "kv_producer"}', data_parallel_size=2)
    EngineArgs(kv_transfer_config='{"kv_role": "kv_producer"}', data_parallel_size=2,
               data_parallel_backend="processes")
    wild = EngineArgs(kv_transfer_config='{"kv_role": "kv_producer"}', data_parallel_size=2,
                      data_parallel_backend="processes", host="0.0.0.0")
    with pytest.raises(ValueError, match="needs kv_ip"):
        check_kv_transfer(wild)
    check_kv_transfer(wild.replace(kv_transfer_config='{"kv_role": "kv_consumer"}'))
    with pytest.raises(ValueError, match="past 65535"):
        check_kv_transfer(wild.replace(
            kv_transfer_config='{"kv_role": "kv_consumer", "kv_port": 65535}'))


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(DP router URL, its replica URLs, co-located server, kv_both server)."""
    path = tmp_path_factory.mktemp("tiny_hf")
    save_tiny_checkpoint(path)
    flags = [str(path), "--data-parallel-size", "2", "--data-parallel-backend", "processes",
             "--data-parallel-routing", "round_robin", "--port", "0",
             "--served-model-name", "tiny", "--enable-admin-routes",
             "--kv-transfer-config", json.dumps(KV_BOTH)]
    for k, v in SMALL.items():
        flags += [f"--{k.replace('_', '-')}", *map(str, v if isinstance(v, list) else [v])]
    proc, url, replicas, _ = spawn_dp_server(flags)
    made: list[ServerThread] = []
    try:
        from jaxserve.model.loader.load import load_model
        from jaxserve.server.launch import build_engine
        m = load_model(str(path), dtype="auto", progress=False)   # as the replicas do
        for kv in (None, json.dumps(KV_BOTH)):
            args = tiny_args(kv_transfer_config=kv)
            made.append(ServerThread(build_engine(args, m.config, m.weights, m.tokenizer,
                                                  warmup=True), m.tokenizer, args))
        wait(lambda: _up(url), 120, "the data-parallel server is not healthy")
        yield url, replicas, made[0], made[1]
    finally:
        for s in made:
            s.stop()
            s.engine.core.shutdown()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


SEQ = [(7 * i) % 120 + 3 for i in range(120)]
PROMPTS = [SEQ[a:b] for a, b in ((0, 20), (0, 33), (5, 60), (7, 107))]
# new to every server's prefix cache when step 3 starts: the decoding replicas pull
# all of it (the same prompts would be mostly local hits there after step 2's prefills)
PROMPTS_B = [SEQ[a:b] for a, b in ((11, 30), (13, 47), (17, 90))]
GREEDY = {"model": "tiny", "temperature": 0, "max_tokens": 8, "ignore_eos": True}


def _text(url: str, body: dict, stream: bool = False) -> str:
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json={**GREEDY, **body}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120,
                      json={**GREEDY, **body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return "".join(c["text"] for e in map(json.loads, lines[:-1]) for c in e["choices"])


def _all_free(urls: list[str]) -> None:
    for u in urls:
        kv = wait_kv_free(u, timeout=15)
        assert kv["num_free_blocks"] == kv["num_blocks"], (u, kv)


def test_dp_replicas_produce_and_consume_kv(servers):
    url, replicas, colo, single = servers
    conn = single.engine.core.kv_connector
    want = [_text(colo.url, {"prompt": p}) for p in PROMPTS]
    want_b = [_text(colo.url, {"prompt": p}) for p in PROMPTS_B]
    # 1. each replica advertises its own endpoint; the KV is where it says
    ports = {}
    for p in PROMPTS[:2]:                   # round robin: one per replica
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            **GREEDY, "prompt": p, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}})
        assert r.status_code == 200, r.text
        kv = r.json()["kv_transfer_params"]
        assert kv["remote_host"] == "127.0.0.1"
        ports[r.headers["x-jaxserve-backend"]] = kv["remote_port"]
        assert _text(single.url, {"prompt": p, "kv_transfer_params": kv}) == want[
            PROMPTS.index(p)]
    assert sorted(ports) == ["0", "1"] and len(set(ports.values())) == 2
    assert conn.stats.loads == 2 and conn.stats.load_failures == 0, conn.stats.failures
    # 2. DP prefills, the one-engine server decodes (it pulls from the replicas)
    router = pd_router([url], [single.url])
    try:
        for p, w in zip(PROMPTS, want):
            assert _text(router.url, {"prompt": p}) == w
            assert _text(router.url, {"prompt": p}, stream=True) == w
    finally:
        router.stop()
    assert conn.stats.load_failures == 0, conn.stats.failures
    assert conn.stats.loads >= 2 + len(PROMPTS) and conn.stats.blocks_loaded > 0
    # 3. the one-engine server prefills, the DP replicas decode (they pull from it)
    served = conn.server.served
    router = pd_router([single.url], [url])
    try:
        for p, w in zip(PROMPTS_B, want_b):
            assert _text(router.url, {"prompt": p}) == w
            assert _text(router.url, {"prompt": p}, stream=True) == w
    finally:
        router.stop()
    assert conn.server.served - served >= len(PROMPTS_B)    # the replicas pulled
    wait(lambda: len(conn.store) == 0, 15, "a saved prefill was left on the kv_both server")
    _all_free([single.url, *replicas])
