"""The HTTP server in-process on a scripted engine: every request "generates" the
pieces it is told to, one streamed delta each, so the server's reading of a model's
output (reasoning tags, tool calls split anywhere) is tested exactly and in
milliseconds; no model, no compile. What it does not stand in for (scheduling,
sampling) the tests on the tiny model cover.

    engine = ScriptedEngine(["<think>", "hmm</think>", "Paris"])
    client = openai_client(app_client(engine, reasoning_parser="deepseek_r1"))
"""
from __future__ import annotations

from typing import Any

import openai
import transformers
from starlette.testclient import TestClient
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from jaxserve.config import EngineArgs
from jaxserve.frontend.input_processor import InputLimits, InputProcessor
from jaxserve.request import CompletionOutput, Logprob, RequestOutput
from jaxserve.sampling.params import RequestOutputKind, SamplingParams

# Words a Qwen-style template writes, so that a rendered prompt decodes back to its text
WORDS = ["<think>", "</think>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant",
         "tools:"]
FIRST_ID = 20       # the scripted pieces' token ids: 20, 21, ... (w-words)


def word_tokenizer(vocab_size: int = 128) -> transformers.PreTrainedTokenizerFast:
    """Word-level: the template words above, then "w{i}" (whitespace-split, joined
    with spaces when decoded)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in WORDS + [f"w{i}" for i in range(vocab_size)]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


class ScriptedStream:
    def __init__(self, pieces: list[str], params: SamplingParams, rid: str,
                 prompt: list[int], tokenizer: Any = None) -> None:
        self.params, self.rid, self.prompt = params, rid, prompt
        whole = params.output_kind is RequestOutputKind.FINAL_ONLY
        self.pieces = ["".join(pieces)] if whole else list(pieces)
        ids = [[FIRST_ID + i] for i in range(len(pieces))] if tokenizer is None else \
            [list(tokenizer.encode(p, add_special_tokens=False)) for p in pieces]
        self.ids = [[t for piece in ids for t in piece]] if whole else ids
        self.finished = False

    async def next(self) -> RequestOutput:
        text, ids = self.pieces.pop(0), self.ids.pop(0)
        self.finished = not self.pieces
        lps = None if self.params.logprobs is None else \
            [{t: Logprob(-0.5, 1), 3: Logprob(-1.5, 2)} for t in ids]
        outs = [CompletionOutput(i, text, list(ids), logprobs=lps,
                                 finish_reason="stop" if self.finished else None)
                for i in range(self.params.n)]
        return RequestOutput(self.rid, None, self.prompt, outs, self.finished)

    def close(self) -> None:
        pass


class ScriptedEngine:
    """What the server uses of AsyncEngine; `prompts` records every prompt submitted,
    `params` its sampling params. A piece is one token (ids 20, 21, ...), or, given a
    tokenizer, the tokens it encodes to."""

    def __init__(self, pieces: list[str], max_model_len: int = 512,
                 vocab_size: int = 160, tokenizer: Any = None) -> None:
        self.pieces, self.tokenizer = pieces, tokenizer
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.inputs = InputProcessor(InputLimits(), vocab_size=vocab_size,
                                     max_model_len=max_model_len)
        self.metrics: Any = None
        self.accepting = True
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []      # and their sampling params

    def snapshot(self) -> dict[str, Any]:
        return {"num_blocks": 0}        # the app reads it once, for cache_config_info

    def admit(self, num_seqs: int) -> None:
        pass

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                    prompt_text: str | None = None, cache_salt: str | None = None,
                    lora: Any = None, lora_name: str | None = None) -> ScriptedStream:
        self.prompts.append(list(prompt_ids))
        self.params.append(params)
        return ScriptedStream(self.pieces, params, request_id, list(prompt_ids),
                              self.tokenizer)

    def check_health(self) -> None:
        pass

    async def shutdown(self, timeout: float) -> None:
        pass


def app_client(engine: ScriptedEngine, tokenizer: Any = None, **args: Any) -> TestClient:
    """The full app (build_app) on `engine`, with these EngineArgs, in-process."""
    from jaxserve.server.api import build_app
    tokenizer = tokenizer or word_tokenizer()
    app = build_app(engine, tokenizer, model_name="m",  # type: ignore[arg-type]
                    args=EngineArgs(**args))
    return TestClient(app)


def openai_client(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", max_retries=0,
                         http_client=http)
