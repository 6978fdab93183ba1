"""EngineArgs: the one source of truth for CLI flags, YAML config files and Python kwargs.

Each field's metadata carries its help text (and, for some, choices / bounds). The CLI is
generated from the fields (`--max-num-seqs` for `max_num_seqs`; jaxserve/cli_args.py), a
YAML file uses the snake_case names as keys, and precedence is: defaults < YAML file < CLI
flags / kwargs.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A bad configuration value; the message names the key (and the file)."""


def _f(default: Any, help: str, *, choices: tuple | None = None, min: float | None = None,
       max: float | None = None, group: str = "engine") -> Any:
    md = {"help": help, "choices": choices, "min": min, "max": max, "group": group}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=md)
    return field(default=default, metadata=md)


@dataclass
class EngineArgs:
    # model
    model: str | None = _f(None, "HF directory (safetensors), .gguf file, orbax dir "
                                 "(from `jaxserve convert`) or Hugging Face repo id "
                                 "(org/name, through the HF cache); default: embedded "
                                 "SmolLM2-135M-Instruct",
                           group="model")
    task: str = _f("auto", "generate (completions, chat) or embed (/v1/embeddings: the "
                           "model's final hidden states pooled, no LM head); auto = embed "
                           "for a sentence-transformers checkpoint (modules.json with a "
                           "Pooling module), generate otherwise",
                   choices=("auto", "generate", "embed"), group="model")
    pooler_config: dict | None = _f(None, "an embedding model's pooling, vLLM's keys (JSON "
                                          "on the command line): {\"pooling_type\": "
                                          "\"LAST\" or \"MEAN\", \"normalize\": true}; "
                                          "default: the checkpoint's sentence-transformers "
                                          "config, else LAST, normalised", group="model")
    dtype: str = _f("auto", "weights/activations dtype; auto = float32 on CPU, bfloat16 on GPU/TPU",
                    choices=("auto", "float32", "bfloat16"), group="model")
    quantization: str | None = _f(None, "weights: int8 / fp8 (per output channel, made at "
                                        "load), gguf (a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K "
                                        "matrices kept quantized: on CPU streamed by the C++ "
                                        "kernel, elsewhere dequantized in the step), "
                                        "none; default: gguf for quantized GGUF files on "
                                        "GPU/TPU, none otherwise (docs/benchmarks.md)",
                                  choices=(None, "none", "int8", "fp8", "gguf"), group="model")
    max_model_len: int | None = _f(None, "max prompt + output tokens per request "
                                         "(default: min(model's max, 2048))", min=1, group="model")
    served_model_name: list[str] | None = _f(None, "model name(s) the API reports and "
                                                   "accepts: the first is the primary, "
                                                   "every one is listed by /v1/models "
                                                   "(default: the repo id, or the model "
                                                   "file / directory name)", group="model")
    skip_tokenizer_init: bool = _f(False, "load no tokenizer (Python API, token-id prompts "
                                          "in, token ids out, empty text): runs checkpoints "
                                          "without tokenizer files", group="model")
    seed: int = _f(0, "engine seed (unseeded sampling, prefix-hash key derivation)", group="model")
    # cache
    block_size: int = _f(16, "tokens per KV block", min=1, max=1024, group="cache")
    num_kv_blocks: int | None = _f(None, "KV blocks in the pool (overrides --kv-cache-memory)",
                                   min=2, group="cache")
    kv_cache_memory: int | None = _f(None, "KV cache size in bytes (default: 1 GiB on CPU, "
                                           "--kv-cache-memory-fraction of free memory on GPU/TPU)",
                                     min=1, group="cache")
    kv_cache_memory_fraction: float = _f(0.85, "fraction of free device memory for the KV cache "
                                               "on GPU/TPU", min=0.01, max=0.99, group="cache")
    kv_cache_dtype: str = _f("auto", "KV cache storage: auto (the --dtype), int8 or fp8 "
                                     "(e4m3; both with a float32 scale per token and KV "
                                     "head): ~4x (vs float32) / ~2x (vs bfloat16) the "
                                     "blocks in the same memory",
                             choices=("auto", "int8", "fp8"), group="cache")
    enable_prefix_caching: bool = _f(True, "reuse KV blocks of shared prompt prefixes", group="cache")
    kv_offload_bytes: int = _f(0, "host memory (bytes) for prefix-cache blocks evicted from "
                                  "the device KV pool: a later prompt with the same prefix "
                                  "copies them back instead of computing them (LRU; 0 = no "
                                  "host tier)", min=0, group="cache")
    kv_offload_dir: str | None = _f(None, "directory for a disk tier behind the host tier: "
                                          "every offloaded block is also written there as a "
                                          "checksummed file, read back on a hit, kept across "
                                          "restarts and shareable by engines of the same "
                                          "model on this host", group="cache")
    kv_offload_dir_bytes: int = _f(4 << 30, "most bytes of block files this engine keeps in "
                                            "--kv-offload-dir (LRU)", min=1, group="cache")
    # scheduler
    max_num_seqs: int = _f(64, "max requests in one step", min=1, max=4096, group="scheduler")
    max_num_batched_tokens: int = _f(512, "token budget of one step", min=1, group="scheduler")
    long_prefill_token_threshold: int = _f(0, "cap on one request's prefill chunk per step "
                                              "(0 = off)", min=0, group="scheduler")
    token_buckets: list[int] = _f([], "padded step sizes to compile (default: 1 and "
                                      "powers of two from 4 on CPU, powers of two from 8 "
                                      "on GPU/TPU, up to --max-num-batched-tokens)",
                              group="scheduler")
    attention_backend: str | None = _f(None, "reference (jnp), pallas (GPU/TPU kernel) or cpu "
                                             "(C++ kernel, compiled on first use); default: "
                                             "pallas on GPU/TPU, cpu on CPU (reference when "
                                             "sharded or no compiler)",
                                       choices=(None, "reference", "pallas", "cpu"), group="scheduler")
    tpu_attention_kernel: str = _f("v3", "the pallas backend's TPU kernel: v3 (head-major "
                                         "cache, in-kernel KV loops), tiled (head-major, "
                                         "BlockSpec-pipelined pages) or pm (page-major "
                                         "cache, one DMA per page; the engine allocates "
                                         "the cache page-major; on CPU the TPU interpreter "
                                         "runs it). pm refuses kv_transfer_config, KV "
                                         "offload and draft-model / self speculation "
                                         "(docs/kernels.md)",
                                   choices=("v3", "tiled", "pm"), group="scheduler")
    cpu_matmul_kernel: str = _f("auto", "auto: on CPU without a sharding plan, with float32 "
                                        "weights, the layer projections and the head are "
                                        "stored in 32-column panels and every matmul on them "
                                        "runs a C++ kernel streaming them once (built with "
                                        "the CPU attention kernel; a tied head keeps a packed "
                                        "copy of the embedding); off: XLA's dot everywhere",
                                choices=("auto", "off"), group="scheduler")
    cpu_int8_activations: bool = _f(False, "with the CPU matmul kernel: quantize each "
                                           "matmul's input to int8 per 32 values and "
                                           "multiply in integers, as llama.cpp does, for "
                                           "4-bit weights (GGUF Q4_0 / Q4_1 / Q4_K blocks, "
                                           "the default model's file) at steps of <= 8 "
                                           "rows (AVX2 CPUs), and for 8-bit weights (Q8_0, "
                                           "--quantization int8) at larger steps on CPUs "
                                           "with AVX512-VNNI: faster where the float path "
                                           "is bound by its instructions; outputs no "
                                           "longer bit-equal to the float32 model "
                                           "(docs/kernels.md)",
                                    group="scheduler")
    greedy_head: str = _f("auto", "auto: with the CPU matmul kernel (above), a step of <= 8 "
                                  "rows that all only need the argmax of their logits "
                                  "(greedy, no logprobs, penalties, logit_bias, min_tokens or "
                                  "structured output) finds each token from a float16 copy "
                                  "of the head (~half the head's bytes) and rechecks the "
                                  "candidates in float32: the same tokens, proven by a "
                                  "bound; off: always the float32 logits",
                          choices=("auto", "off"), group="scheduler")
    step_mode: str = _f("auto", "how the step is compiled: fused (one jitted function), "
                                "layerwise (one jitted layer called per layer: ~num_layers x "
                                "faster compiles) or hybrid (fused for steps of <= 8 tokens, "
                                "layerwise above); auto = hybrid on CPU, fused on GPU/TPU",
                        choices=("auto", "fused", "layerwise", "hybrid"), group="scheduler")
    layers_per_call: int = _f(0, "layerwise step: consecutive layers compiled into one "
                                 "call (fewer dispatches per step, longer compiles); 0 = "
                                 "auto (chosen by measurement, see docs/benchmarks.md)",
                              min=0, max=1024, group="scheduler")
    pipeline_steps: bool = _f(True, "dispatch step N+1 before step N's outputs are "
                                    "detokenized and streamed, so output processing overlaps "
                                    "the device", group="scheduler")
    async_scheduling: bool = _f(True, "with --pipeline-steps: dispatch step N+1 before step "
                                      "N's sampled tokens reach the host (they feed step N+1 "
                                      "on the device; the host learns them one step later)",
                                group="scheduler")
    decode_steps: int = _f(0, "multi-step decode: up to this many decode steps run back to "
                              "back in one device program when every running request is "
                              "decoding and nothing waits (the host's work per token falls "
                              "~k-fold; tokens reach the host and streams k at a time); "
                              "batches the fused step runs (<= 8 requests on CPU); 1 = off; "
                              "0 = auto: 4 on CPU (one host, one device, no speculative "
                              "decoding), 1 elsewhere", min=0, max=64, group="scheduler")
    multi_step_streams: bool = _f(False, "run multi-step decode also while a running request "
                                         "streams (its tokens then arrive k at a time, each "
                                         "gap between chunks k tokens long); default: only "
                                         "when no running request streams (offline "
                                         "generate, non-streaming HTTP)", group="scheduler")
    max_n: int = _f(16, "largest n (samples per request) accepted", min=1, max=128, group="scheduler")
    speculative_config: dict | None = _f(None, "speculative decoding, vLLM's keys (JSON on "
                                               "the command line, a mapping in YAML): "
                                               "{\"method\": \"ngram\", "
                                               "\"num_speculative_tokens\": k, "
                                               "\"prompt_lookup_max\": n, "
                                               "\"prompt_lookup_min\": m, "
                                               "\"disable_by_batch_size\": b}; "
                                               "default: off", group="scheduler")
    max_logprobs: int = _f(20, "largest logprobs / prompt_logprobs accepted", min=0, max=20,
                           group="scheduler")
    # per-request limits (frontend/input_processor.py); each bounds host work per token or
    # per request on the engine thread / event loop. The max= values are hard ceilings
    # that the HTTP schema also enforces before parsing further (server/protocol.py).
    max_stop_strings: int = _f(16, "stop strings per request (OpenAI allows 4)", min=0,
                               max=1024, group="limits")
    max_stop_string_chars: int = _f(256, "characters per stop string", min=1, max=65536,
                                    group="limits")
    max_stop_token_ids: int = _f(64, "stop_token_ids per request", min=0, max=1024,
                                 group="limits")
    max_logit_bias: int = _f(64, "logit_bias entries per request (the sampler's table is 64 "
                                 "wide; OpenAI allows 300)", min=0, max=64, group="limits")
    max_sequences_per_request: int = _f(1024, "prompts x n of one HTTP request", min=1,
                                        max=65536, group="limits")
    max_input_chars: int = _f(1 << 20, "characters of prompt text (all prompts / messages) "
                                       "of one request, checked before tokenization", min=1,
                              group="limits")
    # parallel
    tensor_parallel_size: int = _f(1, "devices one model is sharded over", min=1, group="parallel")
    data_parallel_size: int = _f(1, "engine replicas", min=1, group="parallel")
    enable_expert_parallel: bool = _f(False, "MoE models: split the experts whole over the "
                                             "tensor-parallel devices (expert parallelism) "
                                             "instead of splitting every expert's hidden "
                                             "size; attention stays tensor-parallel",
                                      group="parallel")
    data_parallel_backend: str = _f("threads", "replicas as threads of one process, or as "
                                               "processes behind the router (serve only; "
                                               "jaxserve/router/dp_processes.py)",
                                    choices=("threads", "processes"), group="parallel")
    data_parallel_routing: str = _f("least_load", "with processes: the router policy in "
                                                  "front of the replicas",
                                    choices=("round_robin", "least_load", "prefix"),
                                    group="parallel")
    replica_start_timeout: float = _f(1800.0, "with processes: seconds a replica process "
                                              "may take from its start to a healthy "
                                              "/health (loading + warm-up) before it is "
                                              "killed (SIGTERM, then SIGKILL) and "
                                              "restarted; 0: no limit", min=0,
                                      group="parallel")
    # parallel: sharding rules and multi-host (jaxserve/parallel, core/multihost/engine.py)
    sharding_rules: str | None = _f(None, "YAML of logical-axis -> mesh-axis rules, with an "
                                          "optional `mesh: {data: N, model: M}` section "
                                          "(default: configs/sharding/default.yaml)",
                                    group="parallel")
    num_hosts: int = _f(1, "processes (hosts) running one model together", min=1,
                        group="parallel")
    host_rank: int = _f(0, "this process's rank; rank 0 schedules and serves HTTP", min=0,
                        group="parallel")
    coordinator: str | None = _f(None, "HOST:PORT of rank 0 for multi-host start-up (the "
                                       "control channel uses PORT+1)", group="parallel")
    multihost_timeout: float = _f(30.0, "seconds without a heartbeat from another rank before "
                                        "the service stops with an error", min=1.0,
                                  group="parallel")
    multihost_secret_file: str | None = _f(None, "file holding the secret every rank of a "
                                                 "multi-host run shares (default: env "
                                                 "JAXSERVE_MULTIHOST_SECRET; see docs/parallel.md)",
                                           group="parallel")
    kv_transfer_config: str | None = _f(None, "disaggregated prefill/decode, as vLLM's flag: "
                                              "JSON like '{\"kv_role\": \"kv_producer\"}' "
                                              "(kv_producer | kv_consumer | kv_both; more "
                                              "keys in jaxserve/kv_transfer/config.py)",
                                        group="parallel")
    # LoRA adapters (vLLM's flags; docs/serving.md "LoRA adapters")
    enable_lora: bool = _f(False, "serve LoRA adapters (PEFT format) on the base model: "
                                  "requests name one by model (HTTP) or lora_request "
                                  "(Python)", group="lora")
    lora_modules: list[str] | None = _f(None, "adapters served by name: name=path, or JSON "
                                              "'{\"name\": ..., \"path\": ..., "
                                              "\"base_model_name\": ...}' (needs "
                                              "--enable-lora)", group="lora")
    max_loras: int = _f(1, "distinct adapters in one step (device slots; requests of "
                           "further adapters wait)", min=1, max=64, group="lora")
    max_lora_rank: int = _f(16, "largest adapter rank accepted (the slots' width)", min=1,
                            max=512, group="lora")
    max_cpu_loras: int | None = _f(None, "loaded adapters kept in host memory (least "
                                         "recently used dropped); default: max_loras",
                                   min=1, max=4096, group="lora")
    allow_runtime_lora_updating: bool = _f(False, "serve POST /v1/load_lora_adapter and "
                                                  "/v1/unload_lora_adapter (behind the API "
                                                  "key)", group="lora")
    # server
    host: str = _f("127.0.0.1", "address to bind", group="server")
    port: int = _f(8000, "port to bind", min=0, max=65535, group="server")
    api_key: str | None = _f(None, "require `Authorization: Bearer KEY` on every route "
                                   "except /health (and /metrics with --public-metrics)",
                             group="server")
    public_metrics: bool = _f(False, "serve /metrics without the API key", group="server")
    metrics_compat: str = _f("jaxserve", "Prometheus names: jaxserve (jaxserve:*) or vllm "
                                         "(vLLM's vllm:* names, types, buckets and labels, "
                                         "for its dashboards and the Gateway API Inference "
                                         "Extension)", choices=("jaxserve", "vllm"),
                             group="server")
    enable_admin_routes: bool = _f(False, "serve the admin routes (/reset_prefix_cache, "
                                          "/admin/*); off: they do not exist", group="server")
    enable_prompt_tokens_details: bool = _f(False, "report usage.prompt_tokens_details."
                                                   "cached_tokens (reveals prefix-cache hits "
                                                   "across clients)", group="server")
    enable_auto_tool_choice: bool = _f(False, "let chat requests use tool_choice \"auto\" "
                                              "(also the default when tools are given): "
                                              "the model decides whether to call, and "
                                              "--tool-call-parser reads its calls",
                                       group="server")
    tool_call_parser: str | None = _f(None, "how tool_choice \"auto\" reads calls in the "
                                            "output: hermes (<tool_call>{...}</tool_call>) "
                                            "or llama3_json (bare JSON); see docs/serving.md",
                                      choices=(None, "hermes", "llama3_json"), group="server")
    reasoning_parser: str | None = _f(None, "split the model's <think>...</think> reasoning "
                                            "from its answer into reasoning_content: "
                                            "deepseek_r1 (the output starts inside the "
                                            "reasoning) or qwen3 (only after a <think>); "
                                            "see docs/serving.md",
                                      choices=(None, "deepseek_r1", "qwen3"), group="server")
    trust_request_chat_template: bool = _f(False, "let a chat request bring its own "
                                                  "chat_template (a Jinja template is code "
                                                  "the server runs: only for trusted clients)",
                                           group="server")
    max_waiting_requests: int = _f(1024, "sequences admitted beyond --max-num-seqs before new "
                                         "requests get 503 + Retry-After", min=0,
                                   group="server")
    limit_concurrency: int = _f(1000, "open connections + tasks beyond which uvicorn answers "
                                      "503", min=1, group="server")
    request_header_timeout: float = _f(10.0, "seconds a connection may take to send a "
                                             "request's headers before it is closed", min=0.1,
                                       group="server")
    request_body_timeout: float = _f(30.0, "seconds to receive a request body (408 after)",
                                     min=0.1, group="server")
    step_timeout: float = _f(300.0, "seconds the engine loop may go without turning (one "
                                    "step, one admission, ...) before /health reports the "
                                    "engine stalled (503); compiles of unwarmed shapes "
                                    "count", min=1.0, group="server")
    shutdown_timeout: float = _f(10.0, "seconds to finish in-flight requests on SIGTERM", min=0,
                                 group="server")
    max_request_body_bytes: int = _f(4 * 1024 * 1024, "largest accepted HTTP body", min=1024,
                                     group="server")
    max_stored_responses: int = _f(1024, "/v1/responses kept in memory for GET and "
                                         "previous_response_id (least recently used "
                                         "dropped first); 0: none kept", min=0,
                                   group="server")
    stored_response_ttl: float = _f(3600.0, "seconds a stored /v1/responses response is "
                                            "kept after its last use", min=1.0,
                                    group="server")

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, str):     # one name, as Python callers give it
            self.served_model_name = [self.served_model_name]
        self.validate()

    # ---- validation -------------------------------------------------------------------
    def validate(self, source: str = "arguments") -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            md = f.metadata
            if md.get("choices") and value not in md["choices"]:
                raise ConfigError(f"{f.name}: {value!r} is not one of "
                                  f"{[c for c in md['choices'] if c is not None]} ({source})")
            if value is None or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                if md.get("min") is not None and value < md["min"]:
                    raise ConfigError(f"{f.name}: {value} is below the minimum {md['min']} ({source})")
                if md.get("max") is not None and value > md["max"]:
                    raise ConfigError(f"{f.name}: {value} is above the maximum {md['max']} ({source})")
        if self.max_num_batched_tokens < self.block_size:
            raise ConfigError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at "
                              f"least block_size ({self.block_size}) ({source})")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError(f"enable_auto_tool_choice needs tool_call_parser (hermes or "
                              f"llama3_json) ({source})")
        if any((not isinstance(b, int)) or b < 1 for b in self.token_buckets):
            raise ConfigError(f"token_buckets: every bucket must be a positive int ({source})")
        if self.kv_transfer_config is not None:
            self._check_kv_transfer(source)
            if self.kv_cache_dtype != "auto":   # kv_transfer/blocks.py moves plain arrays
                raise ConfigError(f"kv_cache_dtype {self.kv_cache_dtype} cannot be combined "
                                  f"with kv_transfer_config yet ({source})")
        if (self.kv_offload_bytes or self.kv_offload_dir) and self.num_hosts > 1:
            raise ConfigError(f"kv_offload_bytes / kv_offload_dir: not with a multi-host "
                              f"engine (num_hosts 1) ({source})")
        if self.speculative_config is not None:
            self._check_speculative(source)
        if self.pooler_config is not None:
            self._check_pooler(source)
        self._check_lora(source)
        self._check_page_major(source)

    def _check_page_major(self, source: str) -> None:
        """Features that index KV blocks in the head-major layout refuse the page-major
        cache of tpu_attention_kernel pm (attention/kv_layout.py) instead of reading
        the wrong rows."""
        if self.tpu_attention_kernel != "pm":
            return
        spec = self.speculative_config
        method = spec.get("method") if isinstance(spec, dict) else None
        if isinstance(spec, str):     # JSON text (Python callers), before _check_speculative
            method = json.loads(spec).get("method")
        used = [name for name, on in (
            ("kv_transfer_config", self.kv_transfer_config is not None),
            ("kv_offload_bytes / kv_offload_dir", bool(self.kv_offload_bytes
                                                       or self.kv_offload_dir)),
            (f"speculative_config method {method}", method in ("self", "draft_model")))
            if on]
        if used:
            raise ConfigError(f"tpu_attention_kernel pm (page-major KV cache) cannot be "
                              f"combined with {', '.join(used)} yet: they copy KV blocks "
                              f"in the head-major layout; use --tpu-attention-kernel v3 "
                              f"({source})")

    def _check_lora(self, source: str) -> None:
        if not self.enable_lora:
            if self.lora_modules or self.allow_runtime_lora_updating:
                raise ConfigError(f"lora_modules / allow_runtime_lora_updating need "
                                  f"enable_lora ({source})")
            return
        from jaxserve.lora import parse_lora_modules
        try:
            parse_lora_modules(self.lora_modules)
        except ValueError as e:
            raise ConfigError(f"{e} ({source})") from None
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least "
                              f"max_loras ({self.max_loras}) ({source})")
        if self.kv_transfer_config is not None:
            raise ConfigError(f"enable_lora: not with kv_transfer_config yet ({source})")
        for name, value in (("data_parallel_size", self.data_parallel_size),
                            ("num_hosts", self.num_hosts)):
            if value > 1:
                raise ConfigError(f"enable_lora: not with {name} > 1 yet ({source})")

    def _check_pooler(self, source: str) -> None:
        from jaxserve.model.pooling import PoolingConfig, apply_pooler_config
        if isinstance(self.pooler_config, str):    # JSON text (Python callers)
            self.pooler_config = json.loads(self.pooler_config)
        if not isinstance(self.pooler_config, dict):
            raise ConfigError(f"pooler_config: must be a mapping ({source})")
        try:
            apply_pooler_config(PoolingConfig("last", True), self.pooler_config)
        except ValueError as e:
            raise ConfigError(f"{e} ({source})") from None

    def _check_speculative(self, source: str) -> None:
        from jaxserve.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
        try:
            SpeculativeConfig.from_dict(self.speculative_config)
        except SpeculativeConfigError as e:
            raise ConfigError(f"{e} ({source})") from None
        if isinstance(self.speculative_config, str):    # JSON text (Python callers)
            self.speculative_config = json.loads(self.speculative_config)

    def _check_kv_transfer(self, source: str) -> None:
        from jaxserve.kv_transfer.config import parse_kv_transfer_config
        try:
            parse_kv_transfer_config(self.kv_transfer_config or "")
        except ValueError as e:
            raise ConfigError(f"{e} ({source})") from None
        if self.num_hosts > 1:
            raise ConfigError(f"kv_transfer_config: not with a multi-host engine (num_hosts "
                              f"1); run one server per host ({source})")
        if self.data_parallel_size > 1 and self.data_parallel_backend != "processes":
            # in-process replicas would share one server's transfer endpoint and
            # kv_transfer_params name no replica; replica processes each have their own
            raise ConfigError(f"kv_transfer_config with data_parallel_size > 1 needs "
                              f"data_parallel_backend processes (one transfer endpoint "
                              f"per replica process), not {self.data_parallel_backend} "
                              f"({source})")

    # ---- sources ------------------------------------------------------------------------
    @classmethod
    def from_sources(cls, config_file: str | Path | None = None, **overrides: Any) -> "EngineArgs":
        values: dict[str, Any] = {}
        if config_file:
            values.update(load_yaml_config(config_file))
        values.update(overrides)
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown setting(s) {sorted(unknown)}")
        try:
            return cls(**values)
        except ConfigError as e:
            if config_file:
                raise ConfigError(f"{e} [config file {config_file}]") from None
            raise

    def replace(self, **kw: Any) -> "EngineArgs":
        return dataclasses.replace(self, **kw)


def load_yaml_config(path: str | Path) -> dict[str, Any]:
    """Read a YAML config (keys = EngineArgs field names); type-check every value."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must be a mapping of setting: value")
    known = {f.name: f for f in fields(EngineArgs)}
    out: dict[str, Any] = {}
    for key, value in data.items():
        key = str(key).replace("-", "_")
        if key not in known:
            raise ConfigError(f"unknown key {key!r} in config file {p}")
        out[key] = coerce_field(known[key], value, f"config file {p}")
    if isinstance(out.get("sharding_rules"), str):
        out["sharding_rules"] = _beside(p, out["sharding_rules"])
    return out


def _beside(config: Path, value: str) -> str:
    """A path a config file names, resolved against the file's own directory (so
    `--config` works from any working directory). A relative path found only under the
    current directory (configs written before this rule) is kept as it is."""
    path = Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    here = config.resolve().parent / path
    if here.exists() or not path.exists():
        return str(here)
    return value


def field_kind(f: dataclasses.Field) -> str:
    """The base type of an EngineArgs field: bool, int, float, str, list or dict."""
    t = str(f.type)
    for name in ("bool", "int", "float", "str", "list", "dict"):
        if t.startswith(name):
            return name
    return "str"


def coerce_field(f: dataclasses.Field, value: Any, source: str) -> Any:
    """value (from a file or a sweep grid) as field f's type; source names it in errors."""
    if value is None:
        if "None" in str(f.type):
            return None
        raise ConfigError(f"{f.name}: may not be null ({source})")
    kind = field_kind(f)
    if kind == "list" and isinstance(value, str) and "list[str]" in str(f.type):
        value = [value]             # one name where several may be given
    ok = {
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "str": isinstance(value, str),
        "list": isinstance(value, list),
        "dict": isinstance(value, dict),
    }[kind]
    if not ok:
        raise ConfigError(f"{f.name}: expected {kind}, got {type(value).__name__} {value!r} ({source})")
    return float(value) if kind == "float" else value
