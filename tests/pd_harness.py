"""A tiny-model `jaxserve serve` with --kv-transfer-config, in a subprocess that a P/D
test can kill: `python tests/pd_harness.py KV_CONFIG_JSON STEP_DELAY_S`."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

ROOT = Path(__file__).resolve().parents[1]


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

    from jaxserve.server.main import build_engine, run_server
    kv_config, delay = sys.argv[1], float(sys.argv[2])
    cfg, weights, tok = tiny_parts()
    args = tiny_args(kv_transfer_config=kv_config, shutdown_timeout=1.0)
    engine = build_engine(args, cfg, weights, tok, warmup=True)
    if delay:
        _patch_step(engine.core, 0, delay)
    return run_server(engine, tok, args, MODEL_NAME)


if __name__ == "__main__":
    sys.exit(_main())
