"""`jaxserve bench throughput`: offline throughput on a named workload."""
from __future__ import annotations

import json
import resource
import time
from typing import Any

from jaxserve.bench.workload import Workload, shared_offline
from jaxserve.sampling.params import SamplingParams


def run_throughput(llm: Any, workload: Workload) -> dict[str, Any]:
    params = SamplingParams(max_tokens=workload.output_len, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    compiles0 = llm.num_compiles
    st = llm.engine.stats
    stats0 = (st.steps, st.host_seconds, st.overlapped_seconds, st.wait_seconds)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    secs = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = llm.engine.stats.steps - stats0[0]
    host = llm.engine.stats.host_seconds - stats0[1]
    overlapped = llm.engine.stats.overlapped_seconds - stats0[2]
    waited = llm.engine.stats.wait_seconds - stats0[3]
    return {
        "workload": workload.name,
        "requests": len(outs),
        "seconds": secs,
        "requests_per_s": len(outs) / secs,
        "output_tokens_per_s": out_tokens / secs,
        "total_tokens_per_s": (out_tokens + workload.num_prompt_tokens) / secs,
        "prompt_tokens": workload.num_prompt_tokens,
        "output_tokens": out_tokens,
        "steps": steps,
        "host_ms_per_step": 1000 * host / max(steps, 1),
        # output processing (detokenize, stop strings, RequestOutputs) done while the next
        # step ran on the device (pipelined steps), and time blocked waiting for results
        "overlapped_ms_per_step": 1000 * overlapped / max(steps, 1),
        "wait_ms_per_step": 1000 * waited / max(steps, 1),
        "recompiles": llm.num_compiles - compiles0,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def achieved_flops(cfg: Any, result: dict[str, Any]) -> float:
    """Approximate FLOP/s: 2 * params-per-token * tokens (attention excluded)."""
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    per_layer = D * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim \
        + cfg.num_heads * cfg.head_dim * D + 3 * D * F
    tokens = result["prompt_tokens"] + result["output_tokens"]
    flops = 2 * per_layer * cfg.num_layers * tokens + 2 * D * V * result["output_tokens"]
    return flops / result["seconds"]


def main(ns: Any, args: Any) -> int:
    from jaxserve import LLM
    llm = LLM(**vars(args))
    wl = shared_offline(llm.model_config.vocab_size, num_prompts=ns.num_prompts,
                        output_len=ns.output_len, seed=ns.workload_seed)
    res = run_throughput(llm, wl)
    res["achieved_gflops"] = achieved_flops(llm.model_config, res) / 1e9
    res["warmup_seconds"] = llm.engine.warmup_seconds
    for k, v in res.items():
        print(f"{k:>22}: {v:.2f}" if isinstance(v, float) else f"{k:>22}: {v}")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
