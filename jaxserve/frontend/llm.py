"""LLM: the offline Python API (vLLM-shaped).

    llm = LLM()                                  # embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    outs[0].outputs[0].text

generate() and chat() return each request's final output whatever the params'
output_kind (vLLM's LLM does the same): they run every request with FINAL_ONLY, so no
per-step outputs are built. add_request() + stepping honours output_kind.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import replace
from typing import Any, Sequence, cast

from tqdm.auto import tqdm

from jaxserve.config import EngineArgs
from jaxserve.core.data_parallel import make_engine
from jaxserve.model.pooling import finish_embedding, pooling_from_args
from jaxserve.frontend.embedding import pooling_params
from jaxserve.frontend.input_processor import InputLimits, InputProcessor
from jaxserve.frontend.output_processor import OutputProcessor
from jaxserve.lora import LoRARegistry, LoRARequest, parse_lora_modules
from jaxserve.request import FinishReason, Request, RequestOutput
from jaxserve.sampling.params import RequestOutputKind, SamplingParams

log = logging.getLogger("jaxserve")

PromptType = str | list[int] | dict[str, Any]


def _per_prompt_loras(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                      n: int) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt, from one for all or a list of n."""
    loras: list[LoRARequest | None] = (
        list(lora_request) if isinstance(lora_request, (list, tuple))
        else [cast(LoRARequest | None, lora_request)] * n)
    if len(loras) != n:
        raise ValueError("lora_request must be one object or one per prompt")
    return loras


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (text, token ids or a dict) or a sequence of them -> a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                            and isinstance(prompts[0], int)):
        return [cast(PromptType, prompts)]
    return list(cast(Sequence[PromptType], prompts))


def child_params(params: SamplingParams) -> list[SamplingParams]:
    """n samples -> n engine requests; seeded ones get seed + i so they differ."""
    if params.n == 1:
        return [params]
    return [replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            for i in range(params.n)]


class LLM:
    def __init__(self, model: str | None = None, *, config: str | None = None,
                 warmup: bool = True, **kwargs: Any) -> None:
        from jaxserve.model.loader.load import load_model
        self.args = EngineArgs.from_sources(config, model=model, **kwargs) if model or kwargs \
            or config else EngineArgs()
        loaded = load_model(self.args.model, dtype=self.args.dtype,
                            quantization=self.args.quantization,
                            skip_tokenizer=self.args.skip_tokenizer_init)
        self._init(loaded.config, loaded.weights, loaded.tokenizer, warmup)

    @classmethod
    def from_weights(cls, model_cfg: Any, weights: Any, tokenizer: Any, *, warmup: bool = True,
                     **kwargs: Any) -> "LLM":
        """Build on weights already in memory (tests, benchmarks, converters)."""
        self = cls.__new__(cls)
        self.args = EngineArgs(**kwargs)
        self._init(model_cfg, weights, tokenizer, warmup)
        return self

    def _init(self, model_cfg: Any, weights: Any, tokenizer: Any, warmup: bool) -> None:
        self.model_config = model_cfg
        self.tokenizer = tokenizer
        eos = tuple(model_cfg.eos_token_ids)
        if not eos and getattr(tokenizer, "eos_token_id", None) is not None:
            eos = (tokenizer.eos_token_id,)
        self.engine = make_engine(self.args, model_cfg, weights, eos_token_ids=eos, warmup=warmup,
                                  tokenizer=tokenizer)
        self.inputs = InputProcessor(InputLimits.from_args(self.args),
                                     vocab_size=model_cfg.vocab_size,
                                     max_model_len=self.engine.max_model_len)
        self.processor = OutputProcessor(tokenizer)
        self._ids = itertools.count()
        # LoRA: the adapters named by lora_modules, and the host cache of loaded ones
        self.lora_registry: LoRARegistry | None = None
        if self.args.enable_lora:
            self.lora_registry = LoRARegistry(
                model_cfg, max_rank=self.args.max_lora_rank,
                max_cpu_loras=self.args.max_cpu_loras or self.args.max_loras)
            for name, path, base in parse_lora_modules(self.args.lora_modules):
                self.lora_registry.register(name, path, base)

    # ---- prompts ------------------------------------------------------------------------
    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """-> (text, token ids); text is size-checked before the tokenizer sees it."""
        if isinstance(prompt, str):
            self._need_tokenizer("text prompts")
            self.inputs.check_request(1, 1, [prompt])
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return self._tokenize(prompt["prompt"])
        return None, list(prompt)

    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise ValueError(f"{what} need a tokenizer, and this LLM was made with "
                             f"skip_tokenizer_init=True: give prompts as token ids "
                             f"({{'prompt_token_ids': [...]}}); outputs carry token ids "
                             f"and empty text")

    def add_request(self, prompt: PromptType, params: SamplingParams,
                    cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> str:
        """Queue one prompt; raises ValueError (SamplingParamsError naming the parameter)
        for a bad prompt or parameter, checked after defaults are filled in (AdapterError,
        a ValueError, for a LoRA adapter that cannot be loaded)."""
        adapter = self._adapter(lora_request)
        self.inputs.check_params(params)          # cheap checks before tokenizing
        self.inputs.check_structured(params)      # the constraint (pool, deadline)
        if params.stop:
            self._need_tokenizer("stop strings (use stop_token_ids)")
        text, ids = self._tokenize(prompt)
        ids, params = self.inputs.process(ids, params)
        rid = str(next(self._ids))
        kids = {f"{rid}-{i}": p for i, p in enumerate(child_params(params))}
        reqs = [Request(cid, ids, p, cache_salt=cache_salt, prompt=text, lora=adapter,
                        lora_name=lora_request.lora_name if lora_request else None)
                for cid, p in kids.items()]
        for r in reqs:
            self.engine.add_request(r)      # raises ValueError if it can never fit
        self.processor.add_request(rid, text, ids, kids, reqs[0].metrics)
        return rid

    def _adapter(self, lora_request: LoRARequest | None) -> Any:
        """The loaded adapter of a lora_request (None: the base model)."""
        if lora_request is None:
            return None
        if self.lora_registry is None:
            raise ValueError("lora_request needs an engine built with enable_lora=True")
        return self.lora_registry.get(lora_request)

    # ---- generation ---------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """lora_request: one adapter for every prompt, or one (or None) per prompt."""
        prompts = _prompt_list(prompts)
        params = sampling_params or SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError("sampling_params must be one object or one per prompt")
        loras = _per_prompt_loras(lora_request, len(prompts))
        # Only the final output is returned, so only it is built (output_kind is
        # overridden on a copy, as vLLM's LLM does; the caller's params are untouched).
        final = RequestOutputKind.FINAL_ONLY
        order = [self.add_request(p, replace(sp, output_kind=final), lora_request=lr)
                 for p, sp, lr in zip(prompts, plist, loras)]
        return self._run(order, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType],
              dimensions: int | None = None, use_tqdm: bool = True,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
              ) -> list[Any]:
        """Each prompt's embedding (float32 numpy [D], or [dimensions]: its first values,
        re-normalised for a normalising model), from an engine serving embeddings
        (task="embed", or a sentence-transformers checkpoint). lora_request: as for
        generate (the embedding of the model with that adapter)."""
        pooling = pooling_from_args(self.args)
        if pooling is None:
            raise ValueError("this model serves generation, not embeddings (task='embed')")
        plist = _prompt_list(prompts)
        order = [self.add_request(p, pooling_params(), lora_request=lr)
                 for p, lr in zip(plist, _per_prompt_loras(lora_request, len(plist)))]
        return [finish_embedding(out.pooled, pooling.normalize, dimensions)
                for out in self._run(order, use_tqdm)]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        convs = cast(list[list[dict[str, str]]],
                     messages if messages and isinstance(messages[0], list) else [messages])
        prompts = [{"prompt_token_ids": self.apply_chat_template(c, add_generation_prompt)}
                   for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> list[int]:
        self._need_tokenizer("chat templates")
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True,
                                                 add_generation_prompt=add_generation_prompt)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def _run(self, order: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="generate", unit="req", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            outputs, stopped = self.processor.process(self.engine.step())
            if stopped:
                self.engine.finish_requests(stopped, FinishReason.STOP)
            for out in outputs:
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[r] for r in order]

    # ---- admin --------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    @property
    def num_compiles(self) -> int:
        return self.engine.num_compiles
