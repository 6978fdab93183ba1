"""Multi-host on one machine: two processes x 2 CPU devices on 127.0.0.1, TP=4 spanning
both (jax.distributed + gloo). Rank 0 schedules and broadcasts each SchedulerOutput;
greedy outputs must equal one device, shutdown must be clean, and killing a rank must
make the other exit with an error within a bounded time.

This file is also the worker: `python tests/model/test_multihost.py RANK PORT MODE`.
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
TESTS = Path(__file__).resolve().parents[1]


def _model():
    sys.path.insert(0, str(TESTS / "support"))
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
    from jaxserve.core.multihost import engine as multihost
    args = EngineArgs(**ENGINE, tensor_parallel_size=4, num_hosts=2, host_rank=rank,
                      coordinator=f"127.0.0.1:{port}", multihost_timeout=TIMEOUT)
    multihost.initialize(args)
    import jax
    assert jax.device_count() == 4 and jax.local_device_count() == 2
    if mode == "restore":
        return restore_worker(args)
    cfg, weights = _model()
    if rank != 0:
        return multihost.follower_main(args, model=(cfg, weights))
    from jaxserve.core.engine_core import EngineCore
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


def restore_worker(args) -> int:
    """Restore an orbax conversion of the default model ($ORBAX_DIR) into the TP=4 mesh;
    check this rank's slices against a whole copy restored onto one local device."""
    import jax
    import numpy as np

    from jaxserve.core.multihost import engine as multihost
    from jaxserve.model.loader.load import load_model
    from jaxserve.parallel.shard import ShardingPlan, mesh_and_rules_from_args
    src = os.environ["ORBAX_DIR"]
    sharded = load_model(src, dtype="float32", shardings=multihost.weight_shardings(args))
    whole = load_model(src, dtype="float32")
    plan = ShardingPlan.build(sharded.config, *mesh_and_rules_from_args(args),
                              log_summary=False)
    leaves = jax.tree.leaves(sharded.weights)
    wants = jax.tree.leaves(plan.param_shardings())
    split = 0
    for got, want, full in zip(leaves, wants, jax.tree.leaves(whole.weights)):
        assert got.sharding == want and got.shape == full.shape, (got.sharding, want)
        assert len(got.addressable_shards) == 2          # this host's two devices only
        for shard in got.addressable_shards:
            assert np.array_equal(np.asarray(shard.data), np.asarray(full)[shard.index])
        assert not got.is_fully_addressable                # a global array of 4 devices
        split += got.addressable_shards[0].data.shape != got.shape
    multihost.shutdown()
    print(f"RESTORED {len(leaves)} arrays, {split} split over the devices", flush=True)
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


def _xla_flags() -> str:
    """Two simulated CPU devices per rank, and otherwise this process's XLA flags: under
    pytest the suite's (tests/conftest.py), which cut what each rank's compiles cost
    without changing what the programs compute; the in-process references compile with
    the same flags."""
    keep = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([*keep, "--xla_force_host_platform_device_count=2"])


def _spawn(rank: int, port: int, mode: str, secret: str | None = None,
           **extra_env: str) -> subprocess.Popen:
    from jaxserve.router.dp_processes import cpu_collective_threads
    env = dict(os.environ, XLA_FLAGS=_xla_flags(),
               JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               PJRT_NPROC=str(cpu_collective_threads(2)), **extra_env)
    env.pop("JAXSERVE_MULTIHOST_SECRET", None)
    if secret is not None:              # else the per-run key comes over the collectives
        env["JAXSERVE_MULTIHOST_SECRET"] = secret
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
    from jaxserve.core.engine_core import EngineCore
    port = _free_port_pair()
    procs = [_spawn(0, port, "once", "s3cret"), _spawn(1, port, "once", "s3cret")]
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


def test_wire_round_trips_a_step_with_every_sampling_params_type():
    """Every type a SamplingParams holds (enums included) must be registered in wire.py,
    else rank 0 cannot send a step at all."""
    import dataclasses
    import enum

    from jaxserve.core.multihost import codec as wire
    from jaxserve.sampling.params import SamplingParams
    from jaxserve.core.sched.output import NewRequestData, SchedulerOutput
    params = SamplingParams(max_tokens=3, temperature=0.5, stop=["x"], seed=7)
    for f in dataclasses.fields(SamplingParams):     # enum-valued fields: every member
        value = getattr(params, f.name)
        for member in (type(value) if isinstance(value, enum.Enum) else ()):
            p = dataclasses.replace(params, **{f.name: member})
            assert wire.decode(wire.encode(p)) == p
    so = SchedulerOutput([NewRequestData("a", [1, 2], 2, params, [3], 0)], [], {"a": 2}, 2)
    assert wire.decode(wire.encode(so)) == so


# ---- secret and bind address -------------------------------------------------------------
def test_secret_comes_from_the_file_then_the_env(tmp_path, monkeypatch):
    import pytest

    from jaxserve.config import ConfigError, EngineArgs
    from jaxserve.core.multihost.engine import configured_secret
    monkeypatch.setenv("JAXSERVE_MULTIHOST_SECRET", "from-env")
    assert configured_secret(EngineArgs()) == b"from-env"
    f = tmp_path / "secret"
    f.write_text("from-file\n")
    f.chmod(0o600)
    assert configured_secret(EngineArgs(multihost_secret_file=str(f))) == b"from-file"
    f.write_text("  \n")
    with pytest.raises(ConfigError, match="is empty"):
        configured_secret(EngineArgs(multihost_secret_file=str(f)))
    with pytest.raises(ConfigError, match="multihost-secret-file"):
        configured_secret(EngineArgs(multihost_secret_file=str(tmp_path / "missing")))
    monkeypatch.delenv("JAXSERVE_MULTIHOST_SECRET")
    assert configured_secret(EngineArgs()) == b""


def test_rank_0_binds_the_coordinators_interface_not_all(monkeypatch):
    import pytest

    from jaxserve.config import ConfigError
    from jaxserve.core.multihost import engine as multihost
    assert multihost.bind_address("127.0.0.1") == "127.0.0.1"
    assert multihost.bind_address("10.1.2.3") == "10.1.2.3"
    fake = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", 0))]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: fake)
    with pytest.raises(ConfigError, match="loopback address 127.0.1.1"):
        multihost.bind_address("myhost")


# ---- control channel authentication (in-process, no devices) -------------------------------
SECRET = b"the-shared-secret"


def _start_leader(num_hosts: int, **kw):
    """Leader on a free loopback port, accepting in a thread -> (port, box, thread)."""
    from jaxserve.core.multihost.control import Leader
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    box: dict = {"fatal": []}

    def run():
        try:
            box["leader"] = Leader(num_hosts, ("127.0.0.1", port), secret=SECRET, timeout=5.0,
                                   on_fatal=box["fatal"].append, **kw)
        except Exception as e:          # noqa: BLE001 - the test inspects it
            box["error"] = e
    import threading
    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(0.2)                     # the listening socket exists
    return port, box, t


def _follower(rank: int, port: int, secret: bytes = SECRET):
    from jaxserve.core.multihost.control import Follower
    return Follower(rank, ("127.0.0.1", port), secret=secret, timeout=5.0, connect_timeout=10,
                    on_fatal=lambda m: None)


def _frames_until_close(sock: socket.socket) -> list[tuple[str, object]]:
    from jaxserve.core.multihost.control import recv_frame
    got = []
    sock.settimeout(10)
    while True:
        try:
            got.append(recv_frame(sock, 1 << 20))
        except (ConnectionError, OSError):
            return got


def test_impostor_without_the_secret_is_refused_and_gets_no_prompt_data():
    import pytest

    from jaxserve.core.multihost import codec as wire
    from jaxserve.core.multihost.control import HandshakeError, recv_frame, send_frame
    port, box, t = _start_leader(2)
    with pytest.raises(HandshakeError, match="authentication failed"):
        _follower(1, port, secret=b"a guess")
    # A raw impostor that claims rank 1 and then listens for whatever comes.
    raw = socket.create_connection(("127.0.0.1", port))
    kind, nonce = recv_frame(raw, 4096)
    assert kind == "challenge" and len(nonce) == 32
    send_frame(raw, "hello", {"rank": 1, "nonce": b"n" * 32, "mac": b"m" * 32})
    real = _follower(1, port)
    t.join(10)
    leader = box["leader"]
    prompt = [101, 202, 303]
    leader.broadcast("step", wire.encode(prompt))
    assert real.recv() == ("step", wire.encode(prompt))
    got = _frames_until_close(raw)
    raw.close()
    assert [k for k, _ in got] == ["refused"] and "authentication" in got[0][1]
    assert len(leader.refused) == 2 and list(leader.conns) == [1]
    leader.stop()
    real.close()
    assert box["fatal"] == []


def test_out_of_range_and_duplicate_ranks_are_refused():
    import pytest

    from jaxserve.core.multihost.control import HandshakeError
    port, box, t = _start_leader(3)
    for bad in (0, 3, 7):
        with pytest.raises(HandshakeError, match=f"rank {bad} is out of range 1..2"):
            _follower(bad, port)
    first = _follower(1, port)
    with pytest.raises(HandshakeError, match="rank 1 is already connected"):
        _follower(1, port)
    second = _follower(2, port)
    t.join(10)
    assert "error" not in box and sorted(box["leader"].conns) == [1, 2]
    box["leader"].stop()
    first.close()
    second.close()


def test_stray_connections_during_start_up_do_not_crash_rank_0():
    port, box, t = _start_leader(2, handshake_timeout=1.0)
    socket.create_connection(("127.0.0.1", port)).close()          # connect, then close
    junk = socket.create_connection(("127.0.0.1", port))
    junk.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")           # not our protocol
    huge = socket.create_connection(("127.0.0.1", port))
    huge.sendall(b"\xff\xff\xff\xff")                                # a 4 GiB frame header
    silent = socket.create_connection(("127.0.0.1", port))          # says nothing at all
    real = _follower(1, port)
    t.join(10)
    assert "error" not in box and list(box["leader"].conns) == [1]
    time.sleep(1.5)                          # the silent one times out meanwhile
    assert len(box["leader"].refused) == 4, box["leader"].refused
    for s in (junk, huge, silent):
        s.close()
    box["leader"].stop()
    real.close()
    assert box["fatal"] == []


def test_a_follower_refuses_a_fake_rank_0():
    import threading

    import pytest

    from jaxserve.core.multihost.control import HandshakeError, recv_frame, send_frame
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def fake_leader():
        conn, _ = srv.accept()
        send_frame(conn, "challenge", b"c" * 32)
        recv_frame(conn, 4096)
        send_frame(conn, "welcome", b"w" * 32)     # cannot compute the real proof
        time.sleep(1)
        conn.close()
    threading.Thread(target=fake_leader, daemon=True).start()
    with pytest.raises(HandshakeError, match="failed to prove"):
        _follower(1, port)
    srv.close()


# ---- the embedded default model on two hosts ---------------------------------------------
def test_orbax_restore_reads_each_hosts_slices_of_the_mesh(tmp_path):
    from jaxserve.model.loader.convert import convert
    convert(None, tmp_path / "orbax")   # the default model as `jaxserve convert` writes it
    port = _free_port_pair()
    procs = [_spawn(r, port, "restore", ORBAX_DIR=str(tmp_path / "orbax")) for r in (0, 1)]
    try:
        results = [p.communicate(timeout=240) for p in procs]
    finally:
        _stop(*procs)
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, f"rank exited {p.returncode}:\n{out}\n{err[-4000:]}"
        # SmolLM2 at TP=4: MLP and vocabulary split (30 x 3 + embed), attention replicated
        assert "RESTORED 272 arrays, 91 split over the devices" in out, out


SERVE_ENGINE = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
                    token_buckets=[32], num_kv_blocks=16)
SERVE_PROMPT = [1, 504, 3458, 282, 4649, 314]     # token ids; the tokenizer plays no part
SERVE_TOKENS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_serve(rank: int, port: int, log: Path) -> subprocess.Popen:
    """`jaxserve serve` with no model named: rank `rank` of 2, TP=4 over 2 x 2 devices."""
    from jaxserve.router.dp_processes import cpu_collective_threads
    env = dict(os.environ, XLA_FLAGS=_xla_flags(),
               JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", JAXSERVE_MULTIHOST_SECRET="s3cret",
               PJRT_NPROC=str(cpu_collective_threads(2)))
    flags = [f"--{k.replace('_', '-')}={v if not isinstance(v, list) else v[0]}"
             for k, v in SERVE_ENGINE.items()]
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", *flags, "--port=0",
           "--tensor-parallel-size=4", "--num-hosts=2", f"--host-rank={rank}",
           f"--coordinator=127.0.0.1:{port}", f"--multihost-timeout={TIMEOUT * 4}"]
    return subprocess.Popen(cmd, cwd=TESTS.parent, env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, text=True)


def _wait_for_url(proc: subprocess.Popen, log: Path, deadline: float) -> str:
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if "serving" in line and "http://" in line:
                return line.split(" on ")[1].split()[0]
        assert proc.poll() is None, f"rank 0 exited {proc.returncode}:\n{log.read_text()[-4000:]}"
        time.sleep(0.5)
    raise AssertionError(f"rank 0 never served:\n{log.read_text()[-4000:]}")


def _complete(url: str) -> dict:
    import urllib.request
    body = json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": SERVE_PROMPT,
                       "max_tokens": SERVE_TOKENS, "temperature": 0.0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_serve_default_model_on_two_hosts_matches_one_process(tmp_path):
    """The converted default model (a safetensors directory) served by two ranks, TP=4:
    each reads it whole and keeps its slices (when it was an orbax checkpoint, rank 1
    failed with orbax's topology mismatch)."""
    from jaxserve.frontend.llm import LLM
    from jaxserve.model.loader.load import load_model
    from jaxserve.sampling.params import SamplingParams
    m = load_model(None)           # converts into $JAXSERVE_CACHE first, in one process
    assert m.format == "safetensors"
    llm = LLM.from_weights(m.config, m.weights, m.tokenizer, warmup=False, **SERVE_ENGINE)
    ref = llm.generate([SERVE_PROMPT], SamplingParams(max_tokens=SERVE_TOKENS, temperature=0.0,
                                                      ignore_eos=True), use_tqdm=False)[0]
    port = _free_port_pair()
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    procs = [_spawn_serve(r, port, logs[r]) for r in (0, 1)]
    try:
        url = _wait_for_url(procs[0], logs[0], time.monotonic() + 420)
        got = _complete(url)
        procs[0].send_signal(signal.SIGTERM)          # rank 0 stops, then tells rank 1
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        _stop(*procs)
    assert codes == [0, 0], "\n".join(f"{p}:\n{p.read_text()[-3000:]}" for p in logs)
    assert "Topology mismatch" not in logs[1].read_text()
    choice = got["choices"][0]
    assert got["usage"]["completion_tokens"] == SERVE_TOKENS == len(ref.outputs[0].token_ids)
    assert choice["text"] == ref.outputs[0].text and choice["text"]


if __name__ == "__main__":
    sys.exit(worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
