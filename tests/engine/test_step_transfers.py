"""Host round trips of a step: one packed host->device transfer per step (plus one per
newly admitted request, its prompt for the penalty state) and no implicit transfers;
device->host, the sampled tokens, and the logprob arrays only for a step with a row that
asked for logprobs;
the GPU form of the step (branch-free sampler programs) draws the same tokens as the
branched CPU form without recompiles; exported for CUDA, its programs hold no
data-dependent conditional (each is a device->host copy and a stream sync on GPU)."""
from __future__ import annotations


import jax
import pytest

from engine_utils import random_prompts, tiny_config, tiny_tokenizer, tiny_weights
from jaxserve import SamplingParams as SP
from jaxserve.worker import step_config as step_config_mod
from jaxserve.frontend.llm import LLM

ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, token_buckets=[32])
MIXED = [SP(max_tokens=6, temperature=0, ignore_eos=True),
         SP(max_tokens=6, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),
         SP(max_tokens=6, temperature=1.0, top_k=5, seed=9, logprobs=2, presence_penalty=0.4,
            ignore_eos=True),
         SP(max_tokens=6, temperature=0, logit_bias={7: 3.0}, min_tokens=3,
            repetition_penalty=1.3),
         SP(max_tokens=6, temperature=1.2, min_p=0.05, seed=11, frequency_penalty=0.5,
            ignore_eos=True)]


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config()
    return cfg, tiny_weights(cfg), tiny_tokenizer()


def _llm(model, monkeypatch, step_mode: str, gpu_form: bool) -> LLM:
    if gpu_form:     # what the runner picks on a GPU: branch-free sampler programs
        monkeypatch.setattr(step_config_mod, "step_platform", lambda plan: "gpu")
    cfg, w, tok = model
    llm = LLM.from_weights(cfg, w, tok, step_mode=step_mode, **ENGINE)
    assert llm.engine.runner.branch is (not gpu_form)
    return llm


def _generate(llm: LLM, n: int = 10) -> list:
    prompts = random_prompts(n, 128, 3, 40, seed=4)
    params = [MIXED[i % len(MIXED)] for i in range(n)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("step_mode,gpu_form", [("layerwise", False), ("fused", True)])
@pytest.mark.slow
def test_one_host_to_device_transfer_per_step(model, monkeypatch, step_mode, gpu_form):
    llm = _llm(model, monkeypatch, step_mode, gpu_form)
    runner = llm.engine.runner
    puts = []
    real_put, real_dispatch = jax.device_put, runner.dispatch
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: (puts.append(1), real_put(*a, **k))[1])
    per_step = []

    def guarded_dispatch(so):
        before = len(puts)
        with jax.transfer_guard_host_to_device("disallow"):   # implicit transfers raise
            step = real_dispatch(so)
        per_step.append((len(puts) - before, len(so.scheduled_new_reqs)))
        return step

    monkeypatch.setattr(runner, "dispatch", guarded_dispatch)
    _generate(llm)
    assert len(per_step) > 5 and any(new == 0 for _, new in per_step)
    assert all(puts == 1 + new for puts, new in per_step), per_step


@pytest.mark.slow
def test_logprob_arrays_come_back_only_for_steps_that_need_them(model, monkeypatch):
    """Two batches: greedy rows without logprobs (each step fetches one array, the
    tokens), then the same with one row asking for logprobs (every step of that batch
    fetches them too, and that row's logprobs hold its tokens)."""
    llm = _llm(model, monkeypatch, "fused", gpu_form=False)
    fetched = []
    real_get = jax.device_get

    def spy_get(x):
        fetched.append(len([a for a in jax.tree_util.tree_leaves(x) if a is not None]))
        return real_get(x)
    monkeypatch.setattr(jax, "device_get", spy_get)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 128, 3, 20, seed=2)]
    plain = SP(max_tokens=5, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, plain, use_tqdm=False)
    assert fetched and set(fetched) == {1}, fetched
    assert all(len(o.outputs[0].token_ids) == 5 and o.outputs[0].logprobs is None
               for o in outs)
    fetched.clear()
    params = [plain, SP(max_tokens=5, temperature=0, logprobs=2, ignore_eos=True), plain]
    outs2 = llm.generate(prompts, params, use_tqdm=False)
    assert fetched and min(fetched) >= 4, fetched
    assert [o.outputs[0].token_ids for o in outs2] == [o.outputs[0].token_ids for o in outs]
    lps = outs2[1].outputs[0].logprobs
    assert lps is not None and len(lps) == 5
    assert all(t in lp for t, lp in zip(outs2[1].outputs[0].token_ids, lps))


@pytest.mark.warmup
@pytest.mark.slow
def test_gpu_form_draws_what_the_cpu_form_draws_without_recompiles(model, monkeypatch):
    """Greedy and seeded rows (the reproducibility contract: a token depends on (seed,
    request, output position)) and logprobs agree; unseeded rows are not compared."""
    cpu = _llm(model, monkeypatch, "fused", gpu_form=False)
    expected = _generate(cpu)
    cpu_compiles = cpu.num_compiles
    gpu = _llm(model, monkeypatch, "fused", gpu_form=True)
    warm = gpu.num_compiles
    runner = gpu.engine.runner
    rows = {runner.buckets.sampler_rows(runner.buckets.rows_for(t))
            for t, _ in runner.buckets.all_shapes()}
    # the forward pass once per bucket (as the CPU form's single program); the sampler
    # once per sampler row count (one plan); prompt logprobs compile on first use
    assert len(runner.plans) == 1
    assert warm == len(runner.buckets.all_shapes()) + len(rows)
    assert cpu_compiles == len(runner.buckets.all_shapes())
    got = _generate(gpu)
    assert gpu.num_compiles == warm, "the GPU form recompiled after warm-up"
    for i, ((toks, lps), (etoks, elps)) in enumerate(zip(got, expected)):
        p = MIXED[i % len(MIXED)]
        if p.temperature == 0 or p.seed is not None:
            assert toks == etoks, i
        if p.logprobs is not None:
            assert lps is not None and len(lps) == len(toks)
            if toks == etoks:
                for a, b in zip(lps, elps):
                    assert a.keys() == b.keys()
                    assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)


def _export_check():
    from jaxserve.tools import export_check
    return export_check


@pytest.mark.slow
def test_cuda_step_has_no_conditionals_tpu_step_keeps_them():
    """The engine's fused step at SmolLM2 shapes with the Pallas kernel, exported for CUDA
    (forward program + every sampler program) and for TPU (one branched program)."""
    ec = _export_check()
    shapes = {}
    for platform in ("cuda", "tpu"):
        ns = ec.parse_args(["--platform", platform, "--shape", "smollm2", "--num-blocks",
                            "256", "--max-buckets", "1", "--tpu-chip", "v5e"])
        if platform == "tpu":
            ec.pretend_tpu(ns.tpu_chip)
        target = ec.Target(ns)
        t, p = target.buckets.all_shapes()[0]
        shapes[platform] = target.export(t, p)
    cuda, tpu = shapes["cuda"], shapes["tpu"]
    assert set(cuda) == {"forward"} | {f"sampler {p}" for p in _plans(branch=False)}
    assert ec.count_kernel_calls(cuda["forward"], ec.KERNEL_TARGETS["cuda"]) == 30
    for name, mlir in cuda.items():
        assert ec.count_conditionals(mlir) == 0, name
    # the check can fail: the branched sampler (CPU/TPU) lowers its lax.conds to case ops
    assert ec.count_conditionals(tpu["step"]) >= 8


def _plans(branch: bool) -> list:
    from jaxserve.sampling.in_step import all_plans
    return all_plans(branch)
