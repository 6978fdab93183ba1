"""/v1/embeddings (OpenAI's), served by an engine that pools (model/pooling.py).

    POST /v1/embeddings {"model": "m", "input": ["a", "b"], "encoding_format": "float",
                         "dimensions": 64}
    -> {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [...]},
        ...], "model": "m", "usage": {"prompt_tokens": N, "total_tokens": N}}

`input` is a string, a list of strings, a list of token ids or a list of such lists; every
input is one engine request (submitted together, so they share steps), at most
--max-model-len tokens (400 context_length_exceeded with OpenAI's wording), and a
request holds at most --max-sequences-per-request inputs and --max-input-chars
characters (the bounds completions' prompts have). `encoding_format` "base64" sends each
embedding as the base64 of its little-endian float32 bytes, as OpenAI does.
`dimensions` keeps the first values (Matryoshka), re-normalised for a normalising model;
above the hidden size it is a 400. A generation server answers this route with a 400,
and an embedding server answers the completion routes with one (`refuse_generation`).
"""
from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any

import numpy as np

from jaxserve.frontend.embedding import pooling_params
from jaxserve.frontend.errors import RequestFailedError
from jaxserve.model.pooling import PoolingConfig, finish_embedding
from jaxserve.server.errors import APIError
from jaxserve.server.protocol import EmbeddingRequest
from jaxserve.server.serving import OpenAIServing


class EmbeddingServing:
    def __init__(self, serving: OpenAIServing, pooling: PoolingConfig | None,
                 hidden_size: int) -> None:
        """pooling: the engine's (None: a generation model, which refuses this route)."""
        self.serving, self.pooling, self.hidden_size = serving, pooling, hidden_size

    def refuse_generation(self) -> None:
        """A completion route on an embedding server: 400 (vLLM answers likewise)."""
        if self.pooling is not None:
            raise APIError(400, f"the model {self.serving.model_name!r} is an embedding "
                                f"model: it serves /v1/embeddings, not completions")

    async def embeddings(self, req: EmbeddingRequest) -> dict[str, Any]:
        serving = self.serving
        serving.check_model(req.model, adapters=False)
        if self.pooling is None:
            raise APIError(400, f"the model {serving.model_name!r} is a generation model: "
                                f"it does not serve /v1/embeddings (start the server with "
                                f"--task embed)", param="model")
        if req.dimensions is not None and not 1 <= req.dimensions <= self.hidden_size:
            raise APIError(400, f"dimensions must be in [1, {self.hidden_size}] (the "
                                f"model's embedding size), got {req.dimensions}",
                           param="dimensions")
        prompts = await asyncio.to_thread(serving.completion_prompts, req.input, 1, "input")
        rid = f"embd-{uuid.uuid4().hex}"
        job, finals = await serving.submit(prompts, pooling_params(), rid, None, "input",
                                           stream=False)
        try:
            data = []
            for i, out in enumerate(finals):
                if out.error or out.pooled is None:
                    raise RequestFailedError(f"request failed: {out.error or 'no embedding'}")
                v = finish_embedding(out.pooled, self.pooling.normalize, req.dimensions)
                data.append({"object": "embedding", "index": i,
                             "embedding": _encode(v, req.encoding_format)})
        finally:
            job.close()
        tokens = sum(len(p.ids) for p in prompts)
        return {"id": rid, "object": "list", "created": int(time.time()), "data": data,
                "model": serving.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encode(v: np.ndarray, encoding_format: str) -> Any:
    """A list of floats, or base64 of the little-endian float32 bytes (OpenAI's)."""
    if encoding_format == "base64":
        return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
    return v.tolist()
