"""`jaxserve serve --data-parallel-size 2 --data-parallel-backend processes`:
the child command rebuilds the same EngineArgs through the real CLI parser,
each child gets its device slice (GPU, TPU, CPU), the supervisor restarts dead children
with backoff and gives up after its limit, and a real run on a tiny HF checkpoint serves
greedy completions equal to transformers' from both replicas, keeps serving while one
replica is SIGKILLed, gets it back, then stops everything on SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest


from jaxserve.cli import build_parser  # noqa: E402
from jaxserve.cli_args import engine_args  # noqa: E402
from jaxserve.config import EngineArgs  # noqa: E402
from jaxserve.router.dp_processes import child_argv, child_env, tpu_env  # noqa: E402
from jaxserve.router.dp_supervisor import RestartPolicy  # noqa: E402
from dp_fakes import supervised  # noqa: E402
from router_harness import wait  # noqa: E402
from server_harness import pid_alive, save_tiny_checkpoint, spawn_dp_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_child_command_rebuilds_the_same_args():
    args = EngineArgs(data_parallel_size=2, data_parallel_backend="processes",
                      tensor_parallel_size=2, token_buckets=[8, 64], api_key="k",
                      enable_prefix_caching=False, max_model_len=512, model="/m",
                      host="0.0.0.0", port=9000, data_parallel_routing="prefix")
    argv = child_argv(args, 1234)
    assert argv[:3] == [sys.executable, "-m", "jaxserve.cli"]
    got = engine_args(build_parser().parse_args(argv[3:]))
    assert got == args.replace(data_parallel_size=1, data_parallel_backend="threads",
                               data_parallel_routing="least_load", host="127.0.0.1",
                               port=1234)


def test_child_device_slices(monkeypatch):
    assert child_env(1, 2, "gpu")["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert "--xla_force_host_platform_device_count=4" in child_env(0, 4, "cpu")["XLA_FLAGS"]
    # a parent started with 8 simulated devices gives each TP=1 child exactly one
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_foo")
    flags = child_env(1, 1, "cpu")["XLA_FLAGS"].split()
    assert sorted(flags) == ["--xla_foo", "--xla_force_host_platform_device_count=1"]
    # the intra-op pool outnumbers the collectives 4 devices can block; a user's value stays
    monkeypatch.delenv("PJRT_NPROC", raising=False)
    assert int(child_env(0, 4, "cpu")["PJRT_NPROC"]) >= 8
    monkeypatch.setenv("PJRT_NPROC", "3")
    assert child_env(0, 4, "cpu")["PJRT_NPROC"] == "3"


def test_tpu_child_env():
    # 8 chips as 2 replicas x 4: each sees its own 4 chips as a one-process 2x2 slice
    env = child_env(1, 4, "tpu", tpu_port=9123)
    assert env["TPU_VISIBLE_CHIPS"] == env["TPU_VISIBLE_DEVICES"] == "4,5,6,7"
    assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,2,1"
    assert env["TPU_PROCESS_BOUNDS"] == "1,1,1"
    assert env["TPU_PROCESS_PORT"] == "9123"
    assert env["TPU_PROCESS_ADDRESSES"] == "localhost:9123"
    assert env["CLOUD_TPU_TASK_ID"] == "0"
    assert env["ALLOW_MULTIPLE_LIBTPU_LOAD"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in tpu_env(0, 1, 1)
    assert tpu_env(3, 1, 1)["TPU_VISIBLE_CHIPS"] == "3"
    assert tpu_env(0, 2, 1)["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,2,1"
    assert tpu_env(0, 8, 1)["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,4,1"
    with pytest.raises(ValueError, match="1, 2, 4 or 8 chips"):
        tpu_env(0, 3, 1)


def test_supervisor_restarts_with_backoff_and_resets_after_a_stable_run():
    sup, pool, spawned, now = supervised(RestartPolicy(max_restarts=3, backoff_s=1.0,
                                                        max_backoff_s=3.0, stable_s=10.0))
    r0 = sup.replicas[0]
    spawned[0].code = -9                        # SIGKILLed
    sup.tick(pool)
    assert pool.downs == [("http://r0", "replica process 100 ended (killed by signal 9)")]
    assert r0.proc is None and len(spawned) == 2    # the other replica is untouched
    now[0] = 0.9
    sup.tick(pool)
    assert len(spawned) == 2                    # backoff: not before 1 s
    now[0] = 1.0
    sup.tick(pool)
    assert len(spawned) == 3 and r0.proc is spawned[2] and r0.restarts == 1
    pool.backends[0].healthy = True             # the router's health check saw it up
    now[0] = 2.0
    sup.tick(pool)
    assert r0.up_since == 2.0 and r0.restarts == 1
    now[0] = 12.0                               # up stable_s: the count starts again
    sup.tick(pool)
    assert r0.restarts == 0
    spawned[2].code = 1                         # dies again: first backoff again
    sup.tick(pool)
    assert r0.restart_at == 13.0


def test_supervisor_gives_up_after_the_limit_and_leaves_clean_exits_alone():
    sup, pool, spawned, now = supervised(RestartPolicy(max_restarts=3, backoff_s=1.0,
                                                        max_backoff_s=3.0, stable_s=10.0))
    r0, r1 = sup.replicas
    delays = []
    for _ in range(3):                          # dies before ever coming back up
        r0.proc.code = 1
        sup.tick(pool)
        delays.append(r0.restart_at - now[0])
        now[0] = r0.restart_at
        sup.tick(pool)
    assert delays == [1.0, 2.0, 3.0]            # doubling, capped at max_backoff_s
    assert r0.restarts == 3 and not r0.given_up
    r0.proc.code = 1
    sup.tick(pool)
    assert r0.given_up and r0.proc is None
    count = len(spawned)
    now[0] += 100
    sup.tick(pool)
    assert len(spawned) == count                # no more restarts
    r1.proc.code = 0                            # stopped on purpose: not restarted
    sup.tick(pool)
    now[0] += 100
    sup.tick(pool)
    assert r1.given_up and len(spawned) == count and not pool.backends[1].healthy


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_hf")
    return out, save_tiny_checkpoint(out)


def _children(pid: int) -> dict[str, int]:
    """backend URL -> pid of each live (not zombie) child of `pid`, from /proc."""
    out = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat[1]) == pid and stat[0] != "Z" and b"--port" in argv:
            out[f"http://127.0.0.1:{argv[argv.index(b'--port') + 1].decode()}"] = int(d)
    return out


def _router_says_healthy(url: str, backend: str) -> bool:
    """The router's own view (its backend_healthy gauge), not the backend's /health."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return f'jaxserve_router:backend_healthy{{backend="{backend}"}} 1.0' in text


def _complete(url: str, model, prompt: list[int], n: int = 6) -> str:
    from engine_utils import hf_greedy
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    want = [f"w{t}" for t in hf_greedy(model, prompt, n) if t > 2]  # 0-2: special, no text
    assert r.json()["choices"][0]["text"].split() == want
    return r.headers["x-jaxserve-backend"]


def _kill_one_and_get_it_back(proc: subprocess.Popen, url: str, backends: list[str],
                              model, log: list[str]) -> None:
    children = _children(proc.pid)
    assert sorted(children) == sorted(backends)
    victim = children[backends[0]]
    results: list[BaseException | str] = []

    def one(prompt: list[int]) -> None:
        try:
            results.append(_complete(url, model, prompt, 24))
        except BaseException as e:      # noqa: BLE001 - reported by the assert below
            results.append(e)
    # requests in flight while replica 0 dies: each is finished there, or retried on
    # replica 1 (a dropped connection before any byte reached the client)
    inflight = [threading.Thread(target=one, args=([7 + i, 8, 9],)) for i in range(4)]
    for t in inflight:
        t.start()
    os.kill(victim, signal.SIGKILL)
    for t in inflight:
        t.join(180)
    assert len(results) == 4 and all(isinstance(x, str) for x in results), results
    for prompt in ([5, 6, 7, 8], [9, 10, 11], [12, 13]):     # the other replica serves
        assert _complete(url, model, prompt) == "1"
    deadline = time.monotonic() + 300       # backoff 1 s, then load + warm-up
    while not _router_says_healthy(url, backends[0]):
        assert time.monotonic() < deadline, "the replica did not come back"
        assert proc.poll() is None, "the parent died"
        time.sleep(1)
    assert not pid_alive(victim)
    restarted = _children(proc.pid)[backends[0]]
    assert restarted != victim
    assert httpx.get(f"{backends[0]}/health", timeout=5).status_code == 200
    assert any("replica 0" in line and "restarting it" in line for line in log)
    seen = {_complete(url, model, p) for p in ([5, 6], [5, 7], [5, 8], [5, 9])}
    assert seen == {"0", "1"}               # round-robin reaches it again


def test_two_replica_processes_behind_the_router(tiny_checkpoint):
    path, model = tiny_checkpoint
    proc, url, backends, log = spawn_dp_server(
        [str(path), "--data-parallel-size", "2", "--data-parallel-backend", "processes",
         "--data-parallel-routing", "round_robin", "--port", "0",
         "--max-num-batched-tokens", "64", "--max-num-seqs", "8", "--max-model-len", "128",
         "--token-buckets", "64", "--num-kv-blocks", "64", "--served-model-name", "tiny"])
    pids: set[int] = set()
    try:
        assert len(backends) == 2
        wait(lambda: _up(url), 60, "the router did not answer")
        pids.update(_children(proc.pid).values())
        seen = {_complete(url, model, p)
                for p in ([5, 6, 7, 8], [9, 10, 11], [5, 6, 7, 8], [40, 41, 42, 43, 44])}
        assert seen == {"0", "1"}           # both replicas served
        _kill_one_and_get_it_back(proc, url, backends, model, log)
        pids.update(_children(proc.pid).values())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        for b in backends:                  # the replicas are gone too
            with pytest.raises(httpx.HTTPError):
                httpx.get(f"{b}/health", timeout=2)
        wait(lambda: not any(pid_alive(p) for p in pids), 10, "a replica process was leaked")
    finally:
        if proc.poll() is None:
            proc.kill()                     # the replicas follow (PR_SET_PDEATHSIG)
            proc.wait(10)
