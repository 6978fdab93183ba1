"""jaxserve: an LLM inference engine on JAX/XLA."""
from jaxserve.config import EngineArgs
from jaxserve.request import CompletionOutput, RequestOutput
from jaxserve.sampling.params import RequestOutputKind, SamplingParams


def __getattr__(name: str):
    if name == "LLM":   # lazy: importing jaxserve should not import jax
        from jaxserve.frontend.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput",
           "EngineArgs"]
