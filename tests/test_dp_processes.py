"""`jaxserve serve --data-parallel-size 2 --data-parallel-backend processes` (issue 18
item 3): the child command rebuilds the same EngineArgs through the real CLI parser,
each child gets its device slice, and a real run on a tiny HF checkpoint serves greedy
completions equal to transformers' from both replicas, then stops them on SIGTERM."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from jaxserve.cli import _args, build_parser  # noqa: E402
from jaxserve.config import EngineArgs  # noqa: E402
from jaxserve.server.dp_processes import child_argv, child_env  # noqa: E402
from router_harness import wait  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_child_command_rebuilds_the_same_args():
    args = EngineArgs(data_parallel_size=2, data_parallel_backend="processes",
                      tensor_parallel_size=2, token_buckets=[8, 64], api_key="k",
                      enable_prefix_caching=False, max_model_len=512, model="/m",
                      host="0.0.0.0", port=9000, data_parallel_routing="prefix")
    argv = child_argv(args, 1234)
    assert argv[:3] == [sys.executable, "-m", "jaxserve.cli"]
    got = _args(build_parser().parse_args(argv[3:]))
    assert got == args.replace(data_parallel_size=1, data_parallel_backend="threads",
                               data_parallel_routing="least_load", host="127.0.0.1",
                               port=1234)


def test_child_device_slices():
    assert child_env(1, 2, "gpu")["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert "--xla_force_host_platform_device_count=4" in child_env(0, 4, "cpu")["XLA_FLAGS"]


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from engine_utils import hf_model_from_weights, tiny_config, tiny_tokenizer, tiny_weights
    cfg = tiny_config()
    weights = tiny_weights(cfg)
    out = tmp_path_factory.mktemp("tiny_hf")
    model = hf_model_from_weights(cfg, weights)
    model.save_pretrained(out)
    tiny_tokenizer(cfg.vocab_size).save_pretrained(out)
    return out, model


def test_two_replica_processes_behind_the_router(tiny_checkpoint):
    from engine_utils import hf_greedy
    path, model = tiny_checkpoint
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.cli", "serve", str(path), "--data-parallel-size",
         "2", "--data-parallel-backend", "processes", "--data-parallel-routing",
         "round_robin", "--port", "0", "--max-num-batched-tokens", "64", "--max-num-seqs",
         "8", "--max-model-len", "128", "--token-buckets", "64", "--num-kv-blocks", "64",
         "--served-model-name", "tiny"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url, backends = "", []
        for line in proc.stdout:            # the router's "routing ... on URL to" line
            if line.startswith("jaxserve router: routing"):
                url = line.split(" on ")[1].split()[0]
                backends = line.rsplit(": ", 1)[1].strip().split(", ")
                break
        assert url and len(backends) == 2, "the router did not start"
        wait(lambda: _up(url), 60, "the router did not answer")
        seen = set()
        for prompt in ([5, 6, 7, 8], [9, 10, 11], [5, 6, 7, 8], [40, 41, 42, 43, 44]):
            r = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            seen.add(r.headers["x-jaxserve-backend"])
            want = [f"w{t}" for t in hf_greedy(model, prompt, 6)]
            assert r.json()["choices"][0]["text"].split() == want
        assert seen == {"0", "1"}           # both replicas served
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        for b in backends:                  # the replicas are gone too
            with pytest.raises(httpx.HTTPError):
                httpx.get(f"{b}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()                     # the replicas follow (PR_SET_PDEATHSIG)
            proc.wait(10)
