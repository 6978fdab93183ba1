"""EngineClient: EngineCore and DataParallelEngine behind one typed interface.

Data parallelism needs 2 devices, which must be configured before JAX starts, so those
checks run in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=2:
`python tests/server/test_engine_client.py engine serve` checks the front's bookkeeping
(it prints a RESULT line), then serves HTTP on a DP=2 engine (before the interface
existed that server died at start reading `core.kv_manager`). One process does both:
each would otherwise start Python and JAX on its own.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "support"))

from jaxserve.core.client import EngineClient, EngineSnapshot  # noqa: E402
from jaxserve.router.dp_processes import cpu_collective_threads  # noqa: E402

DP_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
          "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
          "PJRT_NPROC": str(cpu_collective_threads(2))}


# ---- in-process (one device) ---------------------------------------------------------------
def test_snapshot_total_sums_replicas_but_not_steps():
    a = EngineSnapshot(num_running=2, num_waiting=1, num_preemptions=3, num_blocks=10,
                       num_free_blocks=4, prefix_queries=50, prefix_hits=16, num_compiles=5,
                       steps=7)
    b = EngineSnapshot(num_running=1, num_waiting=0, num_preemptions=0, num_blocks=10,
                       num_free_blocks=10, prefix_queries=30, prefix_hits=0, num_compiles=5,
                       steps=7)
    t = EngineSnapshot.total([a, b], steps=7)
    assert (t.num_running, t.num_waiting, t.num_preemptions) == (3, 1, 3)
    assert (t.num_blocks, t.num_free_blocks, t.prefix_queries, t.prefix_hits) == (20, 14, 80, 16)
    assert (t.num_compiles, t.steps) == (10, 7)
    assert t.kv_usage == 0.3 and a.kv_usage == 0.6 and EngineSnapshot().kv_usage == 0.0
    assert t.as_dict()["kv_usage"] == 0.3


def test_engine_core_snapshot_tracks_its_scheduler_and_cache():
    from engine_utils import tiny_config, tiny_weights

    from jaxserve.config import EngineArgs
    from jaxserve.core.engine_core import EngineCore
    from jaxserve.request import Request
    from jaxserve.sampling.params import SamplingParams
    cfg = tiny_config()
    core = EngineCore(EngineArgs(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64,
                                 token_buckets=[64], num_kv_blocks=16, block_size=16),
                      cfg, tiny_weights(cfg), warmup=False, progress=False)
    assert isinstance(core, EngineClient)
    for i in range(3):
        core.add_request(Request(f"r{i}", [5 + i] * 20, SamplingParams(max_tokens=4,
                                                                      ignore_eos=True)))
    s = core.snapshot()
    assert (s.num_waiting, s.num_running, s.num_blocks, s.num_free_blocks) == (3, 0, 16, 16)
    core.step()
    s = core.snapshot()
    # max_num_seqs=2: two run (2 blocks each for 20 prompt tokens), one waits
    assert (s.num_running, s.num_waiting, s.num_free_blocks) == (2, 1, 12)
    assert s.prefix_queries == 40
    core.abort_requests(["r0", "r2"])
    s = core.snapshot()
    assert (s.num_running, s.num_waiting, s.num_free_blocks) == (1, 0, 14)
    while core.has_unfinished_requests():
        core.step()
    s = core.snapshot()
    assert (s.num_running, s.num_waiting, s.num_free_blocks) == (0, 0, 16)
    assert s.steps == core.stats.steps > 0 and s.num_compiles == core.num_compiles


# ---- data parallel, in a 2-device subprocess -----------------------------------------------
@pytest.fixture(scope="module")
def dp_worker():
    """One 2-device worker: the front's bookkeeping check, then the DP=2 server ->
    (the process, its URL, its output lines, the index of the line with the URL)."""
    proc = subprocess.Popen([sys.executable, __file__, "engine", "serve"], cwd=TESTS.parent,
                            env={**os.environ, **DP_ENV}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        url = _wait_for_url(proc, 300, lines)
        yield proc, url, lines, next(i for i, ln in enumerate(lines) if url in ln)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_data_parallel_front_forgets_finished_and_aborted_requests(dp_worker):
    _, _, lines, _ = dp_worker
    found = [ln for ln in lines if ln.startswith("RESULT ")]
    assert found, "".join(lines)[-4000:]
    res = json.loads(found[0][len("RESULT "):])
    assert res["is_client"]
    assert min(res["loads_after_add"]) > 0, "both replicas should have received requests"
    assert res["snapshot_after_add"] == res["sum_of_replicas_after_add"]
    assert res["tracked_after_add"] == 8
    assert res["tracked_after_abort"] == 5            # 3 aborted, forgotten at once
    assert res["tracked_at_end"] == 0
    assert res["finished"] == 5
    end = res["snapshot_at_end"]
    assert end["num_free_blocks"] == end["num_blocks"] == 2 * 32
    assert end["num_running"] == end["num_waiting"] == 0


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:_total)?\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_serve_with_data_parallel_2_answers_chat_and_metrics_and_exits_on_sigterm(dp_worker):
    proc, url, lines, started = dp_worker
    results: list[dict] = []

    def chat(i: int) -> None:
        body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": " ".join(
                    f"w{5 + i + k}" for k in range(10 + i))}]}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        results.append({"status": r.status_code, **r.json()})

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert len(results) == 6 and all(r["status"] == 200 for r in results), results
    assert all(r["usage"]["completion_tokens"] == 6 for r in results)
    assert all(r["choices"][0]["message"]["content"] for r in results)
    text = httpx.get(f"{url}/metrics", timeout=30).text
    # Every prompt was looked up in its replica's prefix cache exactly once, so the
    # summed counter equals the prompt tokens the responses report.
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in results)
    assert _metric(text, "jaxserve:prefix_cache_queries") == prompt_tokens
    assert _metric(text, "jaxserve:num_requests_running") == 0
    assert _metric(text, "jaxserve:kv_cache_usage_perc") == 0.0
    assert _metric(text, "jaxserve:engine_healthy") == 1.0
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    # SIGTERM: a prompt, clean exit that releases the replicas' step threads itself
    # (EngineClient.shutdown, which the worker makes print a marker).
    sent = time.monotonic()
    proc.terminate()
    code = proc.wait(30)
    waited = time.monotonic() - sent
    # the marker is looked for after the server's start only: the bookkeeping check
    # before it shut its own engine down, before the marker was installed
    for _ in range(50):                 # the reader thread may lag behind the exit
        if any("DP-SHUTDOWN" in ln for ln in lines[started:]):
            break
        time.sleep(0.1)
    out = "".join(lines)[-4000:]
    assert code == 0, out
    assert waited < 15, f"exit took {waited:.1f} s\n{out}"
    assert any("DP-SHUTDOWN" in ln for ln in lines[started:]), out


def _wait_for_url(proc: subprocess.Popen, timeout: float, lines: list[str] | None = None
                  ) -> str:
    """Reads the server's output (into `lines`, until it exits) until it prints its URL."""
    box: dict[str, str] = {}
    lines = [] if lines is None else lines

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "serving" in line and "http://" in line and "url" not in box:
                box["url"] = line.split(" on ")[1].split()[0]
    threading.Thread(target=read, daemon=True).start()
    deadline = threading.Event()
    for _ in range(int(timeout * 10)):
        if "url" in box or proc.poll() is not None:
            break
        deadline.wait(0.1)
    assert "url" in box, "DP server did not start:\n" + "".join(lines)[-4000:]
    return box["url"]


# ---- workers ------------------------------------------------------------------------------
def _engine_worker() -> int:
    from engine_utils import tiny_config, tiny_weights

    from jaxserve.config import EngineArgs
    from jaxserve.core.data_parallel import DataParallelEngine, make_engine
    from jaxserve.request import Request
    from jaxserve.sampling.params import SamplingParams
    cfg = tiny_config()
    args = EngineArgs(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                      token_buckets=[32], num_kv_blocks=32, block_size=16,
                      data_parallel_size=2)
    dp = make_engine(args, cfg, tiny_weights(cfg), warmup=False, progress=False)
    assert isinstance(dp, DataParallelEngine)
    res: dict = {"is_client": isinstance(dp, EngineClient)}
    for i in range(8):
        dp.add_request(Request(f"r{i}", [5 + i] * (6 + i), SamplingParams(
            max_tokens=5, ignore_eos=True)))
    res["loads_after_add"] = dp.loads()
    snap = dp.snapshot().as_dict()
    parts = [r.snapshot() for r in dp.replicas]
    res["snapshot_after_add"] = snap
    res["sum_of_replicas_after_add"] = EngineSnapshot.total(parts, steps=snap["steps"]).as_dict()
    res["tracked_after_add"] = dp.num_tracked_requests
    dp.abort_requests(["r1", "r2", "r6", "unknown"])   # r6 again below: idempotent
    dp.step()
    dp.abort_requests(["r6"])
    res["tracked_after_abort"] = dp.num_tracked_requests
    finished = set()
    while dp.has_unfinished_requests():
        finished |= {o.req_id for o in dp.step() if o.finish_reason is not None}
    res["finished"] = len(finished)
    res["tracked_at_end"] = dp.num_tracked_requests
    res["snapshot_at_end"] = dp.snapshot().as_dict()
    dp.shutdown()
    print("RESULT " + json.dumps(res), flush=True)
    return 0


def _serve_worker() -> int:
    """`jaxserve serve --data-parallel-size 2` on the tiny model: the CLI's own path
    (server.main.serve), with only the model loader (weights and tokenizer) swapped for
    the tiny model."""
    from types import SimpleNamespace

    from server_harness import tiny_args, tiny_parts

    import jaxserve.model.loader.load as loader
    from jaxserve.core.data_parallel import DataParallelEngine
    from jaxserve.server.launch import serve
    cfg, weights, tok = tiny_parts()
    release = DataParallelEngine.shutdown

    def shutdown(self: DataParallelEngine) -> None:
        release(self)
        print("DP-SHUTDOWN: replica threads released", flush=True)
    DataParallelEngine.shutdown = shutdown  # type: ignore[method-assign]
    loader.load_model = lambda *a, **k: SimpleNamespace(  # type: ignore[assignment]
        config=cfg, weights=weights, tokenizer=tok, source="tiny", format="test",
        load_seconds=0.0)
    loader.tokenizer_of = lambda *a, **k: tok   # serve loads it beside the warm-up
    return serve(tiny_args(data_parallel_size=2, max_model_len=64, shutdown_timeout=1.0))


if __name__ == "__main__":
    # each mode named, in order; the first to fail ends the process with its status
    for mode in sys.argv[1:]:
        if code := {"engine": _engine_worker, "serve": _serve_worker}[mode]():
            sys.exit(code)
