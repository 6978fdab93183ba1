"""LoRA on the host: PEFT adapter loading and its errors, the flags (CLI, JSON form,
YAML), the registry's host cache, the batched delta against a per-token reference,
and the scheduler's cap on distinct adapters per step."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from engine_utils import tiny_config
from lora_utils import save_adapter
from jaxserve.cli import build_parser
from jaxserve.config import ConfigError, EngineArgs
from jaxserve.cli_args import engine_args_from_cli
from jaxserve.core.kv.manager import KVCacheManager
from jaxserve.core.sched.scheduler import Scheduler
from jaxserve.lora import LoRARegistry, LoRARequest, parse_lora_modules
from jaxserve.model import lora as lora_model
from jaxserve.model.loader.peft import AdapterError, load_adapter
from jaxserve.request import Request
from jaxserve.sampling.params import SamplingParams

CFG = tiny_config()


def _edit_config(path: Path, **kw) -> None:
    p = path / "adapter_config.json"
    p.write_text(json.dumps({**json.loads(p.read_text()), **kw}))


def test_load_scales_and_layout(tmp_path):
    path = save_adapter(tmp_path / "a", CFG, rank=4, seed=0, targets=("q_proj", "down_proj"),
                        alpha=8, rslora=True)
    ad = load_adapter(path, CFG, max_rank=8)
    assert ad.rank == 4 and ad.scale == pytest.approx(8 / 2)      # rsLoRA: alpha / sqrt(r)
    assert ad.targets == {"wq", "w_down"} and len(ad.weights) == 2 * CFG.num_layers
    a, b = ad.weights[(1, "w_down")]
    assert a.shape == (CFG.intermediate_size, 4) and b.shape == (4, CFG.hidden_size)
    _edit_config(path, use_rslora=False)
    assert load_adapter(path, CFG, max_rank=8).scale == pytest.approx(2.0)
    assert load_adapter(path, CFG, 8).key == ad.key           # the key is the file's hash


@pytest.mark.parametrize("change, needle", [
    (dict(r=16), "rank 16 is above --max-lora-rank 8"),
    (dict(target_modules=["q_proj", "embed_tokens"]), "not adaptable here"),
    (dict(use_dora=True), "DoRA"),
    (dict(rank_pattern={"q_proj": 2}), "rank_pattern"),
    (dict(r=3), "shape [4, 64], expected [3, 64]"),
    (dict(target_modules=["k_proj"]), "q_proj is not in target_modules"),
])
def test_config_errors(tmp_path, change, needle):
    path = save_adapter(tmp_path / "a", CFG, rank=4, seed=0)
    _edit_config(path, **change)
    with pytest.raises(AdapterError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        load_adapter(path, CFG, max_rank=8)


def test_file_errors(tmp_path):
    with pytest.raises(AdapterError, match="no such adapter directory"):
        load_adapter(tmp_path / "missing", CFG, 8)
    path = save_adapter(tmp_path / "a", CFG, rank=4, seed=0)
    wrong = save_adapter(tmp_path / "wrong", tiny_config(hidden_size=32, num_heads=2),
                         rank=4, seed=0)
    with pytest.raises(AdapterError, match="shape"):
        load_adapter(wrong, CFG, 8)          # another base model
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    with pytest.raises(AdapterError, match="only safetensors files are read"):
        load_adapter(path, CFG, 8)
    (path / "adapter_model.safetensors").write_bytes(b"\x80\x04 a pickle, not safetensors")
    with pytest.raises(AdapterError, match="not a safetensors file"):
        load_adapter(path, CFG, 8)
    (path / "adapter_config.json").write_text("{oops")
    with pytest.raises(AdapterError, match="not valid JSON"):
        load_adapter(path, CFG, 8)


def test_flags_cli_json_yaml(tmp_path):
    ns = build_parser().parse_args([
        "serve", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32",
        "--max-cpu-loras", "5", "--lora-modules", "a=/x/a",
        '{"name": "b", "path": "/x/b", "base_model_name": "base"}'])
    args = engine_args_from_cli(ns, model=ns.model_pos)
    assert (args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras) == \
        (True, 3, 32, 5)
    assert parse_lora_modules(args.lora_modules) == [("a", "/x/a", None), ("b", "/x/b", "base")]
    y = tmp_path / "e.yaml"
    y.write_text("enable_lora: true\nmax_loras: 2\nlora_modules:\n  - a=/x/a\n"
                 "  - {name: b, path: /x/b}\n")
    args = EngineArgs.from_sources(y)
    assert parse_lora_modules(args.lora_modules) == [("a", "/x/a", None), ("b", "/x/b", None)]
    for kw, needle in [(dict(lora_modules=["a=/x"]), "need enable_lora"),
                       (dict(enable_lora=True, lora_modules=["nope"]), "not name=path"),
                       (dict(enable_lora=True, lora_modules=["a=/x", "a=/y"]), "twice"),
                       (dict(enable_lora=True, max_loras=4, max_cpu_loras=2), "at least"),
                       (dict(enable_lora=True, data_parallel_size=2), "data_parallel"),
                       (dict(enable_lora=True, kv_transfer_config='{"kv_role": "kv_both"}'),
                        "kv_transfer_config")]:
        with pytest.raises(ConfigError, match=needle):
            EngineArgs(**kw)
    with pytest.raises(ValueError, match="positive"):
        LoRARequest("a", 0, "/x")


def test_registry_host_lru(tmp_path):
    reg = LoRARegistry(CFG, max_rank=8, max_cpu_loras=2)
    paths = [save_adapter(tmp_path / f"a{i}", CFG, rank=2, seed=i) for i in range(3)]
    reqs = [reg.register(f"a{i}", str(p)) for i, p in enumerate(paths)]
    assert reg.cached() == 2 and [r.lora_name for r in reg.requests()] == ["a0", "a1", "a2"]
    first = reg.get(reqs[0])                   # dropped from the cache: read again
    assert reg.get(reqs[0]) is first and reg.cached() == 2
    with pytest.raises(ValueError, match="already loaded"):
        reg.register("a0", str(paths[1]))
    with pytest.raises(AdapterError):
        reg.register("bad", str(tmp_path / "none"))
    assert reg.lookup("bad") is None
    reg.unregister("a1")
    assert reg.lookup("a1") is None


@pytest.mark.parametrize("T,S,form", [(lora_model.GATHER_MAX_TOKENS, 4, "gather"),
                                       (40, 4, "masked"), (150, 12, "blocked"),
                                       (16, 17, "masked")])
def test_delta_equals_per_token_reference(T, S, form):
    assert lora_model.form(T, S) == form
    rng = np.random.default_rng(0)
    fin, fout, r = 12, 10, 3
    a = rng.standard_normal((S, fin, r)).astype(np.float32)
    b = rng.standard_normal((S, r, fout)).astype(np.float32)
    a[0], b[0] = 0, 0
    x = rng.standard_normal((T, fin)).astype(np.float32)
    # slot 1's run spans several blocks, slots 4.. unused (blocked: padded runs)
    slots = np.resize(np.array([0, 1, 2, 3, 1, 0, 2] + [1] * 30, np.int32), T)
    slots[[0, 5]] = 0
    got = lora_model.delta(jnp.asarray(x), jnp.asarray(slots),
                           {"a": jnp.asarray(a.transpose(1, 0, 2)), "b": jnp.asarray(b)})
    want = np.stack([x[t] @ a[s] @ b[s] for t, s in enumerate(slots)])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert not np.asarray(got)[[0, 5]].any()          # base tokens: exactly zero


class _Adapter:
    def __init__(self, key: str) -> None:
        self.key = key


def test_scheduler_caps_distinct_adapters_fcfs():
    kv = KVCacheManager(64, 4, hash_seed=0)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                      block_size=4, max_loras=2)
    ads = [_Adapter(k) for k in "abc"]
    order = [ads[0], ads[1], None, ads[2], ads[0], None]
    for i, ad in enumerate(order):
        sched.add_request(Request(str(i), [5, 6, 7], SamplingParams(max_tokens=2), lora=ad))
    out = sched.schedule()
    started = [n.req_id for n in out.scheduled_new_reqs]
    # the request of adapter c waits at the head, and so do those behind it (no starvation)
    assert started == ["0", "1", "2"]
    sched.finish_requests(["0"], None)          # a's only request: c takes its slot
    assert [n.req_id for n in sched.schedule().scheduled_new_reqs] == ["3"]
    sched.finish_requests(["1"], None)          # then b's: a again, and the base behind it
    assert [n.req_id for n in sched.schedule().scheduled_new_reqs] == ["4", "5"]


def test_runtime_routes_off_without_the_flag():
    """--enable-lora without --allow-runtime-lora-updating: the routes answer 404 with
    the flag to turn on, and load nothing."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from jaxserve.server.api import lora_routes
    from jaxserve.server.errors import install_error_handlers
    app = FastAPI()
    install_error_handlers(app)
    reg = LoRARegistry(CFG, max_rank=8, max_cpu_loras=1)
    lora_routes(app, reg, ["tiny"], allowed=False)
    with TestClient(app) as client:
        for route in ("load_lora_adapter", "unload_lora_adapter"):
            r = client.post(f"/v1/{route}", json={"lora_name": "a", "lora_path": "/x"})
            assert r.status_code == 404
            assert "--allow-runtime-lora-updating" in r.json()["error"]["message"]
    assert reg.requests() == []
