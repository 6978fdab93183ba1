"""The request an embedding is: what `LLM.embed` and the server's /v1/embeddings submit.

An embedding request is an ordinary engine request that pools instead of generating
(SamplingParams.pooled; model/pooling.py, worker/pooling.py): its prompt runs through
the engine's prefill path and the one token its last chunk samples (greedy, the cheapest
sampler path) is not output. Its single output, when finished, carries the pooled
vector in RequestOutput.pooled; `model.pooling.finish_embedding` turns that into the
embedding (normalised, cut to `dimensions`).
"""
from __future__ import annotations

from jaxserve.sampling.params import RequestOutputKind, SamplingParams


def pooling_params() -> SamplingParams:
    """A fresh SamplingParams for one embedding request."""
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, pooled=True,
                          output_kind=RequestOutputKind.FINAL_ONLY)
