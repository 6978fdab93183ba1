"""Multi-host on one machine: two processes x 2 CPU devices on 127.0.0.1, TP=4 spanning
both (jax.distributed + gloo). Rank 0 schedules and broadcasts each SchedulerOutput;
greedy outputs must equal one device, shutdown must be clean, and killing a rank must
make the other exit with an error within a bounded time.

This file is also the worker: `python tests/test_multihost.py RANK PORT MODE`.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

TIMEOUT = 8.0            # --multihost-timeout for the workers (heartbeats every 2 s)
MAX_TOKENS = 6
NUM_PROMPTS = 5
TESTS = Path(__file__).parent


def _model():
    sys.path.insert(0, str(TESTS))
    from engine_utils import tiny_config, tiny_weights
    # 8 heads / 4 KV heads / vocab 1000 / ffn 128: attention, MLP and vocab all split
    # over the 4 devices, so every layer has cross-host collectives.
    cfg = tiny_config(num_heads=8, num_kv_heads=4, head_dim=8, hidden_size=64,
                      intermediate_size=128, vocab_size=1000)
    return cfg, tiny_weights(cfg)


def _prompts(vocab: int) -> list[list[int]]:
    from engine_utils import random_prompts
    return random_prompts(NUM_PROMPTS, vocab, 4, 30, seed=5)


ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, token_buckets=[32],
              num_kv_blocks=24)


def run_greedy(engine, prompts, max_tokens=MAX_TOKENS, prefix="") -> list[list[int]]:
    from jaxserve.request import Request
    from jaxserve.sampling.params import SamplingParams
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"{prefix}{i}", list(p), SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    out: dict[str, list[int]] = {f"{prefix}{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.req_id].extend(o.new_token_ids)
    return [out[f"{prefix}{i}"] for i in range(len(prompts))]


# ---- worker ----------------------------------------------------------------------------
def worker(rank: int, port: int, mode: str) -> int:
    from jaxserve.config import EngineArgs
    from jaxserve.engine import multihost
    args = EngineArgs(**ENGINE, tensor_parallel_size=4, num_hosts=2, host_rank=rank,
                      coordinator=f"127.0.0.1:{port}", multihost_timeout=TIMEOUT)
    multihost.initialize(args)
    import jax
    assert jax.device_count() == 4 and jax.local_device_count() == 2
    cfg, weights = _model()
    if rank != 0:
        return multihost.follower_main(args, model=(cfg, weights))
    from jaxserve.engine.core import EngineCore
    engine = EngineCore(args, cfg, weights, progress=False)
    leader = multihost.attach_leader(engine, args)
    print("READY", flush=True)
    outs = run_greedy(engine, _prompts(cfg.vocab_size))
    print("OUTPUTS " + json.dumps(outs), flush=True)
    n = 0
    while mode == "serve-forever":            # keep stepping until a peer is killed
        run_greedy(engine, _prompts(cfg.vocab_size)[:2], prefix=f"r{n}-")
        n += 1
    leader.stop()
    multihost.shutdown()
    print("CLEAN EXIT", flush=True)
    return 0


# ---- tests ------------------------------------------------------------------------------
def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s2:
                s2.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def _spawn(rank: int, port: int, mode: str) -> subprocess.Popen:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, __file__, str(rank), str(port), mode],
                            cwd=TESTS.parent, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_two_hosts_tp4_match_one_device_and_stop_cleanly():
    from jaxserve.config import EngineArgs
    from jaxserve.engine.core import EngineCore
    port = _free_port_pair()
    procs = [_spawn(0, port, "once"), _spawn(1, port, "once")]
    try:
        results = [p.communicate(timeout=240) for p in procs]
    finally:
        _stop(*procs)
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, f"rank exited {p.returncode}:\n{out}\n{err[-4000:]}"
    out0 = results[0][0]
    assert "CLEAN EXIT" in out0
    got = json.loads(out0.split("OUTPUTS ", 1)[1].splitlines()[0])
    cfg, weights = _model()
    ref = run_greedy(EngineCore(EngineArgs(**ENGINE), cfg, weights, progress=False),
                     _prompts(cfg.vocab_size))
    assert got == ref
    assert all(len(o) == MAX_TOKENS for o in got)


def test_killing_a_rank_stops_the_other_with_an_error():
    port = _free_port_pair()
    leader, follower = _spawn(0, port, "serve-forever"), _spawn(1, port, "serve-forever")
    try:
        deadline = time.monotonic() + 240
        line = ""
        while "READY" not in line:
            assert time.monotonic() < deadline and leader.poll() is None, "rank 0 never got ready"
            line = leader.stdout.readline()
        time.sleep(1.0)                          # let it get into its step loop
        os.kill(follower.pid, signal.SIGKILL)
        t0 = time.monotonic()
        _, err = leader.communicate(timeout=TIMEOUT * 4 + 30)
        waited = time.monotonic() - t0
    finally:
        _stop(leader, follower)
    assert leader.returncode != 0
    assert "rank 1" in err and "fatal" in err, err[-3000:]
    assert waited < TIMEOUT * 4 + 30


if __name__ == "__main__":
    sys.exit(worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
