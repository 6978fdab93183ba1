from jaxserve.sampling.params import SamplingParams  # noqa: F401
