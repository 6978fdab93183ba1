"""The P/D tests' servers (tests/server/test_pd_*.py).

    c = PDCluster.start(parts, make_args, PRODUCER, CONSUMER)   # in-process, threads
    colo, pre, dec, router = c      # co-located reference, prefill, decode, pd router
    settled(pre, dec)               # no saved prefill left, every KV block free
    c.close()
    pd_router([prefill_url], [decode_url])                      # a pd router alone
    proc, url = spawn(KV_CONFIG_JSON, step_delay)               # a server to kill

`python tests/support/pd_harness.py KV_CONFIG_JSON STEP_DELAY_S` is spawn's tiny-model
`jaxserve serve` with --kv-transfer-config (each engine step slowed by STEP_DELAY_S).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

sys.path.insert(0, str(Path(__file__).parent))

from router_harness import Uvicorn, wait  # noqa: E402
from server_harness import ServerThread, wait_kv_free  # noqa: E402

from jaxserve.config import EngineArgs  # noqa: E402
from jaxserve.kv_transfer.config import SECRET_ENV  # noqa: E402
from jaxserve.router import RouterConfig, build_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# every P/D server of these tests, spawned ones included, shares this transfer secret
TRANSFER_SECRET = "pd-harness-transfer-secret"
os.environ[SECRET_ENV] = TRANSFER_SECRET


def pd_router(prefill: list[str], decode: list[str]) -> Uvicorn:
    """`jaxserve router --policy pd` in a thread, checking its backends every 0.1 s."""
    return Uvicorn(build_app(RouterConfig(backends=[], policy="pd", prefill=prefill,
                                          decode=decode, poll_interval=0.1)),
                   lifespan="on")


class PDCluster(NamedTuple):
    """A co-located server (the reference), a producer and a consumer of one model,
    and a pd router over the last two."""
    colo: ServerThread
    pre: ServerThread
    dec: ServerThread
    router: Uvicorn

    @classmethod
    def start(cls, parts: tuple[Any, Any, Any], make_args: Callable[..., EngineArgs],
              producer: str, consumer: str, warmup: bool = True) -> "PDCluster":
        """parts: (model config, weights, tokenizer); make_args(kv_transfer_config=...)
        -> the EngineArgs of each server; warmup=False: each server compiles a step
        shape when a step first needs it (nothing here counts compiles)."""
        from jaxserve.server.launch import build_engine
        cfg, weights, tok = parts
        made = [ServerThread(build_engine(args, cfg, weights, tok, warmup=warmup), tok, args)
                for args in (make_args(kv_transfer_config=kv)
                             for kv in (None, producer, consumer))]
        colo, pre, dec = made
        return cls(colo, pre, dec, pd_router([pre.url], [dec.url]))

    def close(self) -> None:
        self.router.stop()
        for s in (self.colo, self.pre, self.dec):
            s.stop()
            conn = getattr(s.engine.core, "kv_connector", None)
            if conn is not None:
                conn.close()


def settled(pre: ServerThread, dec: ServerThread, wait_s: float = 10) -> None:
    """Every block free on both sides, nothing saved left on the producer."""
    store = pre.engine.core.kv_connector.store
    wait(lambda: len(store) == 0, wait_s, f"{len(store)} saved prefill(s) left")
    for s in (pre, dec):
        kv = wait_kv_free(s.url)
        assert kv["num_free_blocks"] == kv["num_blocks"], kv


def spawn(kv_config: str, step_delay: float) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), kv_config,
                             str(step_delay)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    for line in proc.stdout:                 # wait for the "serving ... on URL" line
        if "serving" in line and "http://" in line:
            return proc, line.split(" on ")[1].split()[0]
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError("P/D server subprocess did not start")


def _main() -> int:
    from server_harness import MODEL_NAME, _patch_step, tiny_args, tiny_parts

    from jaxserve.server.launch import build_engine, run_server
    kv_config, delay = sys.argv[1], float(sys.argv[2])
    cfg, weights, tok = tiny_parts()
    args = tiny_args(kv_transfer_config=kv_config, shutdown_timeout=1.0)
    engine = build_engine(args, cfg, weights, tok, warmup=True)
    if delay:
        _patch_step(engine.core, 0, delay)
    return run_server(engine, tok, args, MODEL_NAME)


if __name__ == "__main__":
    sys.exit(_main())
