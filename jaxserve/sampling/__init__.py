"""Sampling: parameters, the batched jitted sampler, penalties state, stop strings."""
from jaxserve.sampling.params import SamplingParams, SamplingParamsError

__all__ = ["SamplingParams", "SamplingParamsError"]
