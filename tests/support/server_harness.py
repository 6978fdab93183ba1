"""Run a real jaxserve HTTP server on a tiny random model, in a thread or a subprocess.

The tiny model (tests/support/engine_utils.py) has a word-level tokenizer: token i <-> "w{i}",
so texts and token ids are easy to reason about. Shapes are kept to two compiled
buckets (one token bucket x block-table widths {0, 8}) so warm-up stays short.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from jaxserve.config import EngineArgs

SMALL = dict(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128, block_size=16,
             token_buckets=[64], num_kv_blocks=64)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}w3{% endif %}")
MODEL_NAME = "tiny"
ALIAS = "tiny-alias"        # a second served name (tests/server/conftest.py's api_server)
ROOT = Path(__file__).resolve().parents[2]


def tiny_parts() -> tuple[Any, Any, Any]:
    sys.path.insert(0, str(Path(__file__).parent))
    from engine_utils import tiny_config, tiny_tokenizer, tiny_weights
    cfg = tiny_config()
    tok = tiny_tokenizer(cfg.vocab_size)
    tok.chat_template = CHAT_TEMPLATE
    return cfg, tiny_weights(cfg), tok


def save_tiny_checkpoint(out: Path) -> Any:
    """The tiny model as a Hugging Face checkpoint in `out`, for `jaxserve serve`
    processes (they load a path); -> the transformers model (the reference)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from engine_utils import hf_model_from_weights, tiny_config, tiny_tokenizer, tiny_weights
    cfg = tiny_config()
    model = hf_model_from_weights(cfg, tiny_weights(cfg))
    model.save_pretrained(out)
    tiny_tokenizer(cfg.vocab_size).save_pretrained(out)
    return model


def tiny_args(**kw: Any) -> EngineArgs:
    """Admin routes on by default here: tests read /admin/kv to see the KV pool free."""
    return EngineArgs(**{**SMALL, "served_model_name": MODEL_NAME, "port": 0,
                         "enable_admin_routes": True, **kw})


class ServerThread:
    """uvicorn serving build_app(...) on 127.0.0.1:<free port> in a daemon thread."""

    def __init__(self, engine: Any, tokenizer: Any, args: EngineArgs) -> None:
        import uvicorn

        from jaxserve.server.api import build_app
        from jaxserve.server.launch import bind
        self.engine = engine
        self.app = build_app(engine, tokenizer, model_name=MODEL_NAME, args=args)
        self.sock = bind("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(self.app, log_level="warning", lifespan="on",
                             timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            assert self.thread.is_alive(), "server thread died"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def wait_kv_free(url: str, timeout: float = 10.0, **headers: str) -> dict:
    """Poll /admin/kv until every block is free (or timeout); return the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        kv = httpx.get(f"{url}/admin/kv", timeout=5).json()
        if kv["num_free_blocks"] == kv["num_blocks"] or time.monotonic() > deadline:
            return kv
        time.sleep(0.05)


# ---- subprocess server (SIGTERM test): `python tests/support/server_harness.py [--warmup]`
def spawn(extra_args: dict[str, Any] | None = None, warmup: bool = False
          ) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(Path(__file__).resolve())]
    if warmup:
        cmd.append("--warmup")
    for k, v in (extra_args or {}).items():
        cmd += [f"--{k}", str(v)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    for line in proc.stdout:                 # wait for the "serving ... on URL" line
        if "serving" in line and "http://" in line:
            url = line.split(" on ")[1].split()[0]
            return proc, url
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError("server subprocess did not start")


# ---- `jaxserve serve --data-parallel-backend processes` in a subprocess ----
def spawn_dp_server(argv: list[str], timeout: float = 300.0
                    ) -> tuple[subprocess.Popen, str, list[str], list[str]]:
    """`python -m jaxserve.cli serve ARGV...` (data-parallel processes) -> (the parent
    process, the router's URL, the replicas' URLs, its output lines: a thread keeps
    appending them, since a full pipe would block every process writing to it)."""
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "serve", *argv],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    log: list[str] = []
    found: list[str] = []

    def read() -> None:
        for line in proc.stdout:            # the router's "routing ... on URL to" line
            log.append(line)
            if line.startswith("jaxserve router: routing") and not found:
                found.append(line)
    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not found:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait(10)
            raise RuntimeError("the data-parallel server did not start:\n" + "".join(log))
        time.sleep(0.2)
    url = found[0].split(" on ")[1].split()[0]
    return proc, url, found[0].rsplit(": ", 1)[1].strip().split(", "), log


def _stream_events(url: str, got: dict, body: dict) -> None:
    got["events"] = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            got["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got.setdefault("first", time.monotonic())
                    got["events"].append(line[6:])
    except httpx.HTTPError as e:        # the server went away mid-stream
        got["error"] = e


def start_stream(url: str, body: dict) -> tuple[threading.Thread, dict]:
    """Stream `body` from /v1/completions in a thread; return once the first SSE event is
    in. got["events"] collects the data lines, got["first"] the first one's time, and
    got["status"] / got["error"] how the stream went."""
    got: dict = {}
    t = threading.Thread(target=_stream_events, args=(url, got, body), daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while "first" not in got:
        assert time.monotonic() < deadline and t.is_alive(), got
        time.sleep(0.02)
    return t, got


def pid_alive(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def _main() -> int:
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("--warmup", action="store_true")
    p.add_argument("--shutdown_timeout", type=float, default=10.0)
    p.add_argument("--fail_after_steps", type=int, default=0,
                   help="make engine step N raise (an engine-level failure)")
    p.add_argument("--step_delay", type=float, default=0.0,
                   help="sleep this long in every engine step (long streams)")
    p.add_argument("--step_timeout", type=float, default=300.0)
    p.add_argument("--wedge_token", type=int, default=-1,
                   help="a request whose prompt starts with this token id wedges the "
                        "engine thread inside add_request (a busy Python loop)")
    ns = p.parse_args()
    from jaxserve.server.launch import build_engine, run_server
    cfg, weights, tok = tiny_parts()
    args = tiny_args(shutdown_timeout=ns.shutdown_timeout, step_timeout=ns.step_timeout)
    engine = build_engine(args, cfg, weights, tok, warmup=ns.warmup)
    if ns.fail_after_steps or ns.step_delay:
        _patch_step(engine.core, ns.fail_after_steps, ns.step_delay)
    if ns.wedge_token >= 0:
        wedge_add_request(engine.core, ns.wedge_token)
    return run_server(engine, tok, args, MODEL_NAME)


WEDGE_SECONDS = 120.0       # long past any test's deadline, short enough to end by itself


def wedge_add_request(core: Any, token: int, seconds: float = WEDGE_SECONDS) -> None:
    """Test-only fault: core.add_request of a request whose prompt starts with `token`
    spins in Python for `seconds` s, as a pathological admission computation would; the
    engine thread is busy (not blocked in C, not in a step) and its loop stops turning."""
    add = core.add_request

    def wedged(request: Any) -> None:
        if request.prompt_token_ids[:1] == [token]:
            end, x = time.monotonic() + seconds, 0
            while time.monotonic() < end:
                x = (x * 31 + 7) % 1000003
        add(request)
    core.add_request = wedged


def _patch_step(core: Any, fail_at: int, delay: float) -> None:
    step, count = core.step, [0]

    def patched_step() -> Any:
        count[0] += 1
        if fail_at and count[0] >= fail_at:
            raise RuntimeError(f"injected engine failure at step {count[0]}")
        time.sleep(delay)
        return step()
    core.step = patched_step


if __name__ == "__main__":
    sys.exit(_main())
