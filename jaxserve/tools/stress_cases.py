"""The cases of the stress suite that are not single-server attacks: schema fuzzing,
streams with random disconnects, SIGTERM mid-load, engine thread killed, bodies a router
cannot route, a wedged engine thread. Attacks on one server are in stress_attacks.py,
the KV-transfer cases in stress_kv.py.

Each case takes the Target (stress_lib.py) and returns a CaseResult with its figures and
the checks that failed (none: the case passed).
"""
from __future__ import annotations

import asyncio
import contextlib
import io
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from typing import Any, Callable

import httpx

from .stress_lib import (CaseResult, Target, Watch, check_stream, delta, error_code,
                        finished_counts, health, rss_mib, settle)


# ---- 1. schema fuzzing ---------------------------------------------------------------
def schema_fuzz(t: Target, *, max_examples: int = 40, seconds: float = 120.0,
                call_timeout: float = 10.0) -> CaseResult:
    """schemathesis over /openapi.json, valid and invalid inputs for every operation; the
    time is split evenly between operations x modes. A call still running after
    call_timeout s (a long generation) is dropped by the client and counted apart."""
    import schemathesis
    from schemathesis import GenerationMode
    res = CaseResult("schema_fuzz")
    schema = schemathesis.openapi.from_url(f"{t.url}/openapi.json", headers=t.headers(),
                                           timeout=30)
    ops = [r.ok() for r in schema.get_all_operations()]
    modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    budget = seconds / max(1, len(ops) * len(modes))
    statuses: Counter[str] = Counter()
    server_errors: list[str] = []
    for op in ops:
        for mode in modes:
            _fuzz_operation(t, op, mode, max_examples, budget, call_timeout, statuses,
                            server_errors)
    fives = sum(v for k, v in statuses.items() if k.startswith("5"))
    gen_errors = {k: statuses.pop(k) for k in list(statuses) if k.startswith("generator")}
    after = settle(t)
    res.figures = {"operations": [f"{op.method.upper()} {op.path}" for op in ops],
                   "sent": sum(statuses.values()), "by_status": dict(sorted(statuses.items())),
                   "generator_errors": gen_errors,
                   "status_5xx": fives, "leaked_blocks": after["leaked_blocks"],
                   "examples_5xx": server_errors[:5]}
    res.check(fives == 0, f"{fives} server errors: {server_errors[:3]}")
    res.check(statuses.get("conn_error", 0) == 0, "connections failed (server down?)")
    res.check(after["leaked_blocks"] == 0, f"{after['leaked_blocks']} KV blocks leaked")
    res.check(health(t) == 200, "/health not 200 after the fuzz")
    return res


def _fuzz_operation(t: Target, op: Any, mode: Any, max_examples: int, budget: float,
                    call_timeout: float, statuses: Counter[str], errors: list[str]) -> None:
    import requests
    from hypothesis import HealthCheck, Phase, given, settings
    deadline = time.monotonic() + budget

    @settings(max_examples=max_examples, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        if time.monotonic() > deadline:
            return                       # out of this operation's time: skip cheaply
        try:
            r = case.call(base_url=t.url, headers=t.headers(), timeout=call_timeout)
        except requests.Timeout:
            statuses["client_timeout"] += 1
            return
        except requests.ConnectionError:
            statuses["conn_error"] += 1
            return
        statuses[str(r.status_code)] += 1
        if r.status_code >= 500:
            errors.append(f"{op.method.upper()} {op.path} {str(case.body)[:200]} -> "
                          f"{r.status_code} {r.text[:200]}")
    try:
        with contextlib.redirect_stdout(io.StringIO()):    # hypothesis' reproduce hints
            run()
    except Exception as e:      # noqa: BLE001 - a generator limit is not a server fault
        statuses[f"generator_error:{type(e).__name__}"] += 1


# ---- 2. concurrent streams with random disconnects -------------------------------------
MODES = ("read", "before_headers", "after_chunks")
MODE_WEIGHTS = (0.6, 0.15, 0.25)


def _stream_body(t: Target, rng: random.Random) -> tuple[str, dict[str, Any], int]:
    n = rng.choice([1, 1, 1, 2, 3])
    common = {"model": t.model, "stream": True, "n": n, "max_tokens": rng.randint(4, 48),
              "temperature": rng.choice([0.0, 0.7, 1.0]), "ignore_eos": rng.random() < 0.5,
              "seed": rng.randint(0, 1000)}
    if rng.random() < 0.3:
        common["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        ids = [rng.randrange(3, t.vocab_size) for _ in range(rng.randint(2, 40))]
        return "/v1/completions", {**common, "prompt": ids}, n
    return "/v1/chat/completions", {**common, "messages": [
        {"role": "user", "content": f"{t.chat_text} ({rng.randint(0, 99)})"}]}, n


async def _one_stream(client: httpx.AsyncClient, t: Target, rng: random.Random,
                      stats: Counter[str], reasons: Counter[str]) -> None:
    path, body, n = _stream_body(t, rng)
    mode = rng.choices(MODES, MODE_WEIGHTS)[0]
    stats["sent"] += 1
    req = client.build_request("POST", f"{t.url}{path}", json=body, headers=t.headers())
    try:
        if mode == "before_headers":
            try:
                r = await asyncio.wait_for(client.send(req, stream=True), rng.uniform(0, 0.3))
            except asyncio.TimeoutError:
                stats["aborted"] += 1
                stats["aborted_before_headers"] += 1
                return
            await r.aclose()                 # headers came first: leave at once
            stats["aborted"] += 1
            stats["aborted_at_headers"] += 1
            return
        r = await client.send(req, stream=True)
        try:
            await _read_stream(r, n, rng.randint(1, 8) if mode == "after_chunks" else None,
                               stats, reasons)
        finally:
            await r.aclose()
    except httpx.HTTPError as e:
        stats["failed"] += 1
        reasons[f"client:{type(e).__name__}"] += 1


async def _read_stream(r: httpx.Response, n: int, leave_after: int | None,
                       stats: Counter[str], reasons: Counter[str]) -> None:
    if r.status_code != 200:
        await r.aread()
        stats["failed"] += 1
        stats["status_5xx"] += r.status_code >= 500
        reasons[f"{r.status_code}:{error_code(r)}"] += 1
        return
    events: list[str] = []
    async for line in r.aiter_lines():
        if line.startswith("data: "):
            events.append(line[6:])
            if leave_after is not None and len(events) >= leave_after:
                break
    if leave_after is not None and events and events[-1] != "[DONE]":
        stats["aborted"] += 1
        stats["aborted_after_chunks"] += 1
        return
    kind, why = check_stream(events, n)
    stats[kind] += 1
    if kind != "completed":
        reasons[why if kind == "failed" else f"broken:{why}"] += 1


async def _streams(t: Target, duration: float, concurrency: int, seed: int,
                   stats: Counter[str], reasons: Counter[str], rss: list[float]) -> None:
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    end = time.monotonic() + duration

    async def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < end:
            await _one_stream(client, t, rng, stats, reasons)

    async def sample_rss() -> None:
        while time.monotonic() < end:
            rss.append(rss_mib(t.pid))
            await asyncio.sleep(max(1.0, duration / 30))

    async with httpx.AsyncClient(timeout=httpx.Timeout(180, connect=10), limits=limits) as client:
        await asyncio.gather(sample_rss(), *(worker(i) for i in range(concurrency)))


def streams_disconnects(t: Target, *, duration: float = 180.0, concurrency: int = 64,
                        seed: int = 0) -> CaseResult:
    res = CaseResult("streams_disconnects")
    stats: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    rss: list[float] = []
    before = finished_counts(t)
    rss_start = rss_mib(t.pid)
    asyncio.run(_streams(t, duration, concurrency, seed, stats, reasons, rss))
    after = settle(t)
    rss_end = rss_mib(t.pid)
    broken = stats["broken"]
    res.figures = {
        "concurrency": concurrency, "duration_s": duration, "sent": stats["sent"],
        "completed": stats["completed"], "aborted": stats["aborted"],
        "aborted_before_headers": stats["aborted_before_headers"],
        "aborted_at_headers": stats["aborted_at_headers"],
        "aborted_after_chunks": stats["aborted_after_chunks"],
        "failed": dict(reasons), "status_5xx": stats["status_5xx"],
        "lost_or_duplicated": broken, "leaked_blocks": after["leaked_blocks"],
        "settle_s": after["settle_s"], "server_finished": delta(finished_counts(t), before),
        "rss_start_mib": rss_start, "rss_end_mib": rss_end,
        "rss_max_mib": max(rss + [rss_end]), "rss_samples_mib": rss + [rss_end]}
    accounted = stats["completed"] + stats["aborted"] + stats["failed"] + broken
    res.check(stats["status_5xx"] == 0, f"{stats['status_5xx']} 5xx responses")
    res.check(broken == 0, f"{broken} lost or duplicated completions: {dict(reasons)}")
    res.check(accounted == stats["sent"], f"{stats['sent'] - accounted} requests unaccounted")
    res.check(stats["completed"] > 0, "no stream completed")
    res.check(after["leaked_blocks"] == 0 and after["num_running"] == 0,
              f"KV not free after settling: {after}")
    # flat: the pool and the compiled steps are allocated up front; allow allocator noise
    res.check(rss_end - rss_start < max(0.25 * rss_start, 64.0),
              f"RSS grew {rss_start} -> {rss_end} MiB")
    res.check(health(t) == 200, "/health not 200 after the load")
    return res


# ---- 3. SIGTERM mid-load ----------------------------------------------------------------
TEARDOWN_S = 10.0       # allowed for process exit after the server stopped (measured ~8 s)

async def _open_streams(t: Target, bodies: list[dict[str, Any]], ready: float
                        ) -> tuple[list[asyncio.Task[list[str]]], list[asyncio.Event]]:
    """Start one stream per body; return once each has sent its first event."""
    firsts = [asyncio.Event() for _ in bodies]

    async def read(body: dict[str, Any], first: asyncio.Event) -> list[str]:
        events: list[str] = []
        async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10)) as c:
            async with c.stream("POST", f"{t.url}/v1/completions", json=body,
                                headers=t.headers()) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()
        first.set()
        return events
    tasks = [asyncio.create_task(read(b, f)) for b, f in zip(bodies, firsts)]
    await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), ready)
    return tasks, firsts


def _long_bodies(t: Target, count: int, short: int) -> list[dict[str, Any]]:
    """count streams: `short` of them 8 tokens (finish within a drain), the rest as long as
    the context allows (still running at the drain deadline)."""
    out = []
    for i in range(count):
        ids = [3 + (7 * i + j) % (t.vocab_size - 3) for j in range(6)]
        out.append({"model": t.model, "prompt": ids, "stream": True, "ignore_eos": True,
                    "temperature": 0, "n": 1 + (i % 2),
                    "max_tokens": 8 if i < short else t.max_model_len - len(ids)})
    return out


def _classify(results: list[Any], ns: list[int], res: CaseResult) -> Counter[str]:
    outcome: Counter[str] = Counter()
    for got, n in zip(results, ns):
        if isinstance(got, BaseException):
            outcome[f"client:{type(got).__name__}"] += 1
            continue
        kind, why = check_stream(got, n)
        outcome[f"{kind}:{why}" if why else kind] += 1
    return outcome


def sigterm_mid_load(t: Target, proc: subprocess.Popen[Any], *, streams: int = 16,
                     shutdown_timeout: float = 5.0, flush: float = 5.0) -> CaseResult:
    """Open streams, SIGTERM the server: each stream ends completed or with an error
    event + [DONE]; the process exits 0 within shutdown_timeout + uvicorn's flush."""
    res = CaseResult("sigterm_mid_load")
    bodies = _long_bodies(t, streams, short=streams // 4)

    async def go() -> tuple[list[Any], float]:
        tasks, _ = await _open_streams(t, bodies, ready=120)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        got = await asyncio.gather(*tasks, return_exceptions=True)
        return list(got), time.monotonic() - t0
    got, streams_end_s = asyncio.run(go())
    t0 = time.monotonic()
    try:
        code: int | None = proc.wait(timeout=shutdown_timeout + flush + 20)
    except subprocess.TimeoutExpired:
        code = None
    exit_s = streams_end_s + time.monotonic() - t0
    outcome = _classify(got, [b["n"] for b in bodies], res)
    bad = {k: v for k, v in outcome.items() if k not in ("completed", "failed:shutting_down")}
    res.figures = {"sent": streams, "completed": outcome["completed"],
                   "failed": {"shutting_down": outcome["failed:shutting_down"], **bad},
                   "status_5xx": 0, "streams_ended_s": round(streams_end_s, 2),
                   "exit_code": code, "exit_s": round(exit_s, 2),
                   "shutdown_timeout_s": shutdown_timeout}
    res.check(not bad, f"streams that ended otherwise: {bad}")
    res.check(code == 0, f"exit status {code}")
    res.check(streams_end_s <= shutdown_timeout + 2,
              f"streams ended {streams_end_s:.1f} s after SIGTERM")
    # uvicorn's flush, then the interpreter's own exit (engine thread, XLA teardown)
    res.check(exit_s <= shutdown_timeout + flush + TEARDOWN_S, f"exited after {exit_s:.1f} s")
    return res


# ---- 4. engine thread killed ------------------------------------------------------------
def engine_killed(t: Target, kill: Callable[[], None], proc: subprocess.Popen[Any] | None = None,
                  *, streams: int = 4) -> CaseResult:
    """kill() ends the engine thread (from outside the server); /health must turn 503
    within a second, open streams end with engine_dead + [DONE], a new request gets 503
    (or, for `jaxserve serve`, which then exits 1, a refused connection)."""
    res = CaseResult("engine_killed")
    bodies = _long_bodies(t, streams, short=0)

    async def go() -> tuple[list[Any], dict[str, Any]]:
        tasks, _ = await _open_streams(t, bodies, ready=120)
        kill()
        seen = await asyncio.to_thread(_watch_death, t)
        got = await asyncio.gather(*tasks, return_exceptions=True)
        return list(got), seen
    got, seen = asyncio.run(go())
    outcome = _classify(got, [b["n"] for b in bodies], res)
    code = proc.wait(timeout=30) if proc is not None else None
    failed = {k.removeprefix("failed:"): v for k, v in outcome.items() if k != "completed"}
    res.figures = {"sent": streams, "completed": outcome["completed"], "failed": failed,
                   "status_5xx": 0, **seen,
                   "exit_code": code}
    res.check(seen["health_after_s"] < 1.0,
              f"/health still 200 {seen['health_after_s']:.2f} s after the kill")
    res.check(seen["health_status"] in (503, 0), f"/health said {seen['health_status']}")
    res.check(seen["request_status"] in (503, 0),
              f"a request after the death got {seen['request_status']}")
    res.check(outcome["failed:engine_dead"] == streams, f"streams ended {dict(outcome)}")
    if proc is not None:
        res.check(code == 1, f"exit status {code} (a supervisor restarts on 1)")
    return res


def _watch_death(t: Target) -> dict[str, Any]:
    """Poll /health on fresh connections: first non-200 status (0: refused) and when;
    then one completion request's status (0: refused) and error code."""
    t0 = time.monotonic()
    code = health(t, timeout=2)
    while code == 200 and time.monotonic() - t0 < 10:
        code = health(t, timeout=2)
        time.sleep(0.01)
    took = time.monotonic() - t0
    body = {"model": t.model, "prompt": [5, 6], "max_tokens": 2}
    try:
        r = httpx.post(f"{t.url}/v1/completions", json=body, headers=t.headers(), timeout=10)
        req, err = r.status_code, error_code(r)
    except httpx.HTTPError as e:
        req, err = 0, type(e).__name__
    return {"health_status": code, "health_after_s": round(took, 3),
            "request_status": req, "request_error": err}


# ---- 5. a router in front of a server: bodies it cannot route -----------------------------
UNROUTABLE: list[tuple[str, bytes]] = [
    ("nested 100k deep", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("nested 65 deep", b'{"prompt": "x", "x": ' + b"[" * 65 + b"]" * 65 + b"}"),
    ('{"messages": 5}', b'{"messages": 5}'),
    ('{"messages": [5]}', b'{"messages": [5]}'),
    ('{"prompt": [true]}', b'{"prompt": [true]}'),
    ('{"prompt": "x", "n": "2"}', b'{"prompt": "x", "n": "2"}'),
    ('{"prompt": "x", "stream": "yes"}', b'{"prompt": "x", "stream": "yes"}'),
    ('"\\ud800" in prompt', b'{"prompt": "\\ud800"}'),
    ("invalid JSON", b'{"model": "m", "prompt": '),
    ("not UTF-8", b"\xff\xfe\xff"),
]


def router_unroutable(router: Target, backend: Target) -> CaseResult:
    """Bodies a `jaxserve router` cannot route, on both generate routes: each a 400 (an
    OpenAI error object), never a 5xx; a plain request through the router still gets its
    completion. The Watch's victim stream goes through the router. The backend's
    finished-request count over the case is reported (the victim's included)."""
    res = CaseResult("router_unroutable")
    seen: dict[str, Any] = {}
    hdr = {**router.headers(), "content-type": "application/json"}
    with Watch(router) as w:
        before = finished_counts(backend)
        for label, raw in UNROUTABLE:
            for path in ("/v1/completions", "/v1/chat/completions"):
                r = httpx.post(f"{router.url}{path}", content=raw, headers=hdr, timeout=30)
                key = f"{path} {label}"
                seen[key] = {"status": r.status_code, "code": error_code(r)}
                res.check(r.status_code == 400 and "error" in r.json(),
                          f"{key}: {r.status_code} {r.text[:120]}")
        ok = httpx.post(f"{router.url}/v1/completions", headers=router.headers(), timeout=60,
                        json={"model": router.model, "prompt": "Hello", "max_tokens": 4})
        seen["a plain request"] = {"status": ok.status_code, "code": ""}
        res.check(ok.status_code == 200, f"a plain request: {ok.status_code} {ok.text[:120]}")
        forwarded = sum(delta(finished_counts(backend), before).values())
    w.report(res)
    res.figures.update({"sent": len(seen), "seen": seen,
                        "status_5xx": sum(v["status"] >= 500 for v in seen.values()),
                        "backend_finished_during": forwarded})
    return res


# ---- 6. a wedged engine thread ------------------------------------------------------------
def engine_wedged(t: Target, proc: subprocess.Popen[Any], *, wedge_token: int,
                  step_timeout: float, shutdown_timeout: float, exit_slack: float = 5.0
                  ) -> CaseResult:
    """A stream open, then a request whose prompt starts with `wedge_token` wedges the
    engine thread (the server's test-only hook): /health turns 503 engine_stalled within
    step_timeout + 1 s; SIGTERM ends the open stream with an error event and [DONE] and
    the process with a non-zero status within shutdown_timeout + exit_slack s (the drain,
    then the documented second for the engine and half second for its thread). The
    Watch's figures are reported; the server is meant to go unhealthy, so they are not
    checked."""
    res = CaseResult("engine_wedged")
    body = _long_bodies(t, 1, short=0)[0]
    wedging = {"model": t.model, "prompt": [wedge_token, 5, 6], "max_tokens": 2}
    out: dict[str, Any] = {}

    def post() -> None:
        try:
            r = httpx.post(f"{t.url}/v1/completions", json=wedging, headers=t.headers(),
                           timeout=shutdown_timeout + 60)
            out["status"], out["code"] = r.status_code, error_code(r)
        except httpx.HTTPError as e:
            out["status"], out["code"] = 0, type(e).__name__

    async def go() -> dict[str, Any]:
        tasks, _ = await _open_streams(t, [body], ready=120)
        poster = threading.Thread(target=post, daemon=True)
        sent = time.monotonic()
        poster.start()
        code, stalled = 200, ""
        while code == 200 and time.monotonic() - sent < step_timeout + 10:
            try:
                h = await asyncio.to_thread(httpx.get, f"{t.url}/health", timeout=1)
                code, stalled = h.status_code, error_code(h)
            except httpx.HTTPError:
                code = 0
            if code == 200:
                await asyncio.sleep(0.05)
        unhealthy_s = time.monotonic() - sent
        term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        got = await asyncio.gather(*tasks, return_exceptions=True)
        streams_s = time.monotonic() - term
        exit_code = await asyncio.to_thread(_wait_exit, proc, shutdown_timeout + 30)
        exit_s = time.monotonic() - term
        await asyncio.to_thread(poster.join, 10)
        return {"health_status": code, "health_code": stalled,
                "unhealthy_after_s": round(unhealthy_s, 2), "stream": got[0],
                "stream_ended_s": round(streams_s, 2), "exit_code": exit_code,
                "exit_s": round(exit_s, 2)}

    with Watch(t, expect_healthy=False, after=0) as w:
        seen = asyncio.run(go())
    w.report(res)
    stream = seen.pop("stream")
    kind, why = ("client", type(stream).__name__) if isinstance(stream, BaseException) \
        else check_stream(stream, 1)
    res.figures.update({"sent": 2, "status_5xx": 0, **seen, "stream_outcome": f"{kind}:{why}",
                        "wedging_request": out, "step_timeout_s": step_timeout,
                        "shutdown_timeout_s": shutdown_timeout,
                        "failed": {why: 1} if kind == "failed" else {}})
    res.check(seen["health_status"] == 503 and seen["health_code"] == "engine_stalled",
              f"/health {seen['health_status']} {seen['health_code']}")
    res.check(seen["unhealthy_after_s"] <= step_timeout + 1.0,
              f"/health 503 only {seen['unhealthy_after_s']} s after the wedge "
              f"(step timeout {step_timeout} s)")
    res.check(kind == "failed", f"the open stream ended {kind}: {why}")
    res.check(seen["exit_code"] not in (None, 0), f"exit status {seen['exit_code']}")
    res.check(seen["exit_s"] <= shutdown_timeout + exit_slack,
              f"exited {seen['exit_s']} s after SIGTERM (drain {shutdown_timeout} s)")
    return res


def _wait_exit(proc: subprocess.Popen[Any], within: float) -> int | None:
    try:
        return proc.wait(timeout=within)
    except subprocess.TimeoutExpired:
        return None
