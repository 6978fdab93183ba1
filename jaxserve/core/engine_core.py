"""EngineCore: the step loop, schedule -> execute -> update.

It owns the scheduler (which owns the KV cache manager) and the model runner, and
returns per-request deltas (new token ids, finish reasons). Text, stop strings and
RequestOutputs are the output processor's job (frontend/output_processor.py).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp

from jaxserve.attention.backends import get_attention_backend
from jaxserve.config import EngineArgs
from jaxserve.worker.buckets import BucketSet
from jaxserve.core.client import EngineSnapshot
from jaxserve.worker.compile_cache import enable_compilation_cache
from jaxserve.worker.runner import JaxModelRunner
from jaxserve.worker.kv_device import choose_num_blocks
from jaxserve.attention.kv_quant import check_kv_cache_dtype
from jaxserve.core.external_kv import ExternalKV, make_connector, make_offload
from jaxserve.core.kv.manager import KVCacheManager
from jaxserve.model.cpu import matmul as cpu_matmul
from jaxserve.model import linear as linear_impl
from jaxserve.model.pooling import PoolingConfig, pooling_from_args
from jaxserve.model.tokenizer.load import start_loading
from jaxserve.parallel.shard import plan_from_args, spans_devices
from jaxserve.request import FinishReason, Request
from jaxserve.core.sched.output import SchedulerOutput, StepKind
from jaxserve.core.sched.scheduler import Scheduler
from jaxserve.core.sched.token_stops import ends_on_stop_token
from jaxserve.spec_decode.config import SpeculativeConfig
from jaxserve.worker.drafter.draft import DraftSlots, make_drafter
from jaxserve.worker.drafter.protocol import Drafter
from jaxserve.worker.step_config import StepConfig, resolve_step_config
from jaxserve.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:     # imported when a server has --kv-transfer-config / offloads KV
    from jaxserve.kv_transfer.connector import KVConnector
    from jaxserve.kv_transfer.offload import KVOffload

log = logging.getLogger("jaxserve")

CPU_DEFAULT_MAX_MODEL_LEN = 2048


@dataclass(slots=True)
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: Any = None                  # sampler rows for the new tokens (host)
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list | None = None   # entries for prompt positions 1.. (once)
    pooled: Any = None                    # a pooling request's vector [D] (with its token)
    # the last of new_token_ids is the EOS or stop token that ended the request (the
    # output processor leaves its text out, as vLLM does)
    stop_token: bool = False


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    host_seconds: float = 0.0            # runner: batch building, dispatch, token handling
    device_seconds: float = 0.0          # dispatch until the sampled tokens were on host
    wait_seconds: float = 0.0            # host blocked waiting for the device (collect)
    launch_seconds: float = 0.0          # in the step call: dispatch (on CPU also blocked
                                         # until the step before freed its donated buffers)
    overlapped_seconds: float = 0.0      # caller's output processing while a step ran
    prompt_tokens: int = 0
    generation_tokens: int = 0
    scheduled_tokens: int = 0            # tokens computed by the steps (all rows)
    finished: dict[str, int] = field(default_factory=dict)


def resolve_dtype(name: str) -> Any:
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


class EngineCore:
    def __init__(self, args: EngineArgs, model_cfg: Any, weights: Any, *,
                 eos_token_ids: tuple[int, ...] = (), warmup: bool = True,
                 progress: bool = True, plan: Any = None, tokenizer: Any = None) -> None:
        """tokenizer: the model's (HF fast) tokenizer, or a BackgroundTokenizer, which
        is started when the warm-up starts and read when the engine first needs it (a
        grammar, a draft model's check); with a tokenizer the engine serves structured
        outputs (jaxserve/structured/), without one refuses them."""
        self.args = args
        self.model_cfg = model_cfg
        enable_compilation_cache()
        self.eos_token_ids = tuple(eos_token_ids or model_cfg.eos_token_ids)
        dtype = resolve_dtype(args.dtype)
        cap = model_cfg.max_position_embeddings
        if args.max_model_len is not None and args.max_model_len > cap:
            raise ValueError(f"--max-model-len {args.max_model_len} exceeds the model's "
                             f"max_position_embeddings ({cap})")
        self.max_model_len = args.max_model_len or min(cap, CPU_DEFAULT_MAX_MODEL_LEN)
        # [sharding] an explicit plan (data-parallel replicas) or one from the args
        plan = plan if plan is not None else plan_from_args(args, model_cfg)
        kv_cache_dtype = check_kv_cache_dtype(args.kv_cache_dtype)   # auto | int8 | fp8
        num_blocks = choose_num_blocks(
            model_cfg, args.block_size, dtype, num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory=args.kv_cache_memory, memory_fraction=args.kv_cache_memory_fraction,
            max_model_len=self.max_model_len,
            kv_heads_per_device=plan.kv_heads_per_device if plan is not None else None,
            kv_cache_dtype=kv_cache_dtype)
        self.backend = get_attention_backend(args.attention_backend, plan=plan,
                                             tpu_kernel=args.tpu_attention_kernel)
        self.buckets = BucketSet.build(
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            max_model_len=self.max_model_len, block_size=args.block_size,
            token_buckets=args.token_buckets or None,
            single_table_width=self.backend.single_table_width)
        log.info("engine: max_model_len=%d, max_num_seqs=%d, max_num_batched_tokens=%d, "
                 "attention=%s (%s KV cache), dtype=%s, token buckets=%s, "
                 "block-table buckets=%s",
                 self.max_model_len, args.max_num_seqs, args.max_num_batched_tokens,
                 self.backend.name, self.backend.kv_layout.replace("_", "-"),
                 jnp.dtype(dtype).name, list(self.buckets.token_buckets),
                 list(self.buckets.block_buckets))
        proposer = self._proposer(args)
        self.step_config: StepConfig = resolve_step_config(
            args, num_layers=model_cfg.num_layers, buckets=self.buckets, plan=plan,
            speculative=self.spec is not None)
        # the host order is fixed for the engine's life (vLLM: step vs
        # step_with_batch_queue), so the loop never re-decides it per step
        self.step: Callable[[], list[EngineCoreOutput]] = {
            "async": self.step_async, "pipelined": self.step_pipelined,
            "in_turn": self.step_in_turn}[self.step_config.host_order]
        grammar_gate, mask_words = self._structured(args, model_cfg, tokenizer)
        # embeddings (model/pooling.py): --task embed, or a sentence-transformers checkpoint
        self.pooling: PoolingConfig | None = pooling_from_args(args)
        if self.pooling is not None:
            log.info("embedding model: %s pooling, %s", self.pooling.pooling_type,
                     "normalised" if self.pooling.normalize else "not normalised")
        # matmuls on the C++ kernel, weights packed: CPU, unsharded, f32 (model/cpu/matmul.py)
        self.cpu_matmul = cpu_matmul.enabled(args.cpu_matmul_kernel, sharded=spans_devices(plan),
                                             dtype=dtype)
        # on TPU / GPU: int8 weight-only matrices at decode rows through the Pallas
        # kernel (model/linear.py QuantKernelLinear; per device under a plan), the rest
        # on XLA's dot
        linear = (cpu_matmul.kernel_linear(args.cpu_int8_activations) if self.cpu_matmul else
                  linear_impl.for_platform(jax.default_backend(), sharded=spans_devices(plan),
                                           mesh=getattr(plan, "mesh", None)))
        if linear is linear_impl.XLA_LINEAR:      # the config's own choice stands
            linear = model_cfg.linear
        log.info("matmuls: %s", "C++ CPU kernel on packed weights (layer projections and "
                 "head, every row count)" + (", int8 activations for 4-bit weights at "
                 "decode rows" if args.cpu_int8_activations else "") if self.cpu_matmul else
                 "XLA's dot, int8 weights at decode rows on the Pallas kernel"
                 if isinstance(linear, linear_impl.QuantKernelLinear) else "XLA's dot")
        self.runner = JaxModelRunner(
            dataclasses.replace(model_cfg, linear=linear) if linear is not model_cfg.linear
            else model_cfg,
            weights, num_blocks=num_blocks, block_size=args.block_size,
            buckets=self.buckets, max_model_len=self.max_model_len, attn_backend=self.backend,
            dtype=dtype, seed=args.seed, max_logprobs=args.max_logprobs,
            eos_token_ids=self.eos_token_ids, step=self.step_config, plan=plan,
            num_speculative_tokens=self.spec.num_speculative_tokens if self.spec else 0,
            token_mask_words=mask_words, kv_cache_dtype=kv_cache_dtype,
            drafter=self._drafter_factory(dtype, plan, kv_cache_dtype, tokenizer),
            pooling=self.pooling,
            lora=(args.max_loras, args.max_lora_rank) if args.enable_lora else None)
        self.stats = EngineStats()
        self._inflight: tuple[SchedulerOutput, Any] | None = None   # (so, InflightStep)
        self._returned_at = 0.0
        start_loading(tokenizer)    # a tokenizer still to load loads while this compiles
        self.warmup_seconds = self.runner.warmup(progress) if warmup else 0.0
        # structured outputs on the device; None: every constraint takes the host path
        self._device_structured = (self._make_device_structured(tokenizer)
                                   if tokenizer is not None and args.num_hosts <= 1 else None)
        if grammar_gate is not None:     # regular constraints compile for the device too
            grammar_gate.device = self._device_structured
        # [kv offload] host / disk tiers behind the prefix cache (core/external_kv.py)
        self.kv_offload: KVOffload | None = make_offload(
            args, model_cfg, weights, self.runner, dtype=dtype,
            kv_cache_dtype=kv_cache_dtype, warmup=warmup)
        self.kv_manager = KVCacheManager(
            num_blocks, args.block_size, enable_prefix_caching=args.enable_prefix_caching,
            hash_seed=self.kv_offload.hash_key if self.kv_offload is not None else None)
        if self.kv_offload is not None:
            self.kv_manager.record_evictions()
        # [kv transfer] disaggregated prefill/decode (kv_transfer/connector.py)
        self.kv_connector: KVConnector | None = make_connector(args, self.runner,
                                                               warmup=warmup)
        self.external_kv: ExternalKV | None = ExternalKV(
            self.runner, self.kv_manager, offload=self.kv_offload,
            connector=self.kv_connector) if self.kv_offload or self.kv_connector else None
        self.scheduler = Scheduler(
            self.kv_manager, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=self.max_model_len, block_size=args.block_size,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            fit_chunk=self.buckets.fit_chunk, proposer=proposer,
            decode_steps=self.step_config.decode_steps,
            decode_steps_max_rows=self.step_config.multi_step_rows,
            multi_step_streams=self.step_config.multi_step_streams,
            grammar=grammar_gate, connector=self.kv_connector,
            max_loading_blocks=self.external_kv.max_loading_blocks() if self.external_kv else None,
            offload=self.kv_offload,
            max_loras=args.max_loras if args.enable_lora else 0)

    def _proposer(self, args: EngineArgs) -> Any:
        """The speculative proposer (and self.spec) from args.speculative_config."""
        self.spec = (SpeculativeConfig.from_dict(args.speculative_config)
                     if args.speculative_config is not None else None)
        if self.spec is None:
            return None
        log.info("speculative decoding: %s", self.spec)
        if self.spec.method != "ngram":       # proposals made on the device (draft.py)
            return DraftSlots(self.spec.num_speculative_tokens)
        lo, hi = self.spec.prompt_lookup_min, self.spec.prompt_lookup_max
        assert lo is not None and hi is not None        # from_dict sets both for ngram
        return NgramProposer(self.spec.num_speculative_tokens, lo, hi)

    def _drafter_factory(self, dtype: Any, plan: Any, kv_cache_dtype: str, tokenizer: Any
                         ) -> Callable[[JaxModelRunner], Drafter] | None:
        """What builds the runner's device drafter (`self` / `draft_model`), or None."""
        spec = self.spec
        if spec is None or spec.method == "ngram":
            return None
        return lambda runner: make_drafter(
            spec, runner, dtype=dtype, plan=plan, kv_cache_dtype=kv_cache_dtype,
            max_model_len=self.max_model_len, tokenizer=tokenizer)

    def _speculate_now(self) -> bool:
        """Speculate this step: configured, and the batch is at most
        disable_by_batch_size requests (vLLM's rule; above it, verification costs more
        compute than it saves, and the step stays asynchronous)."""
        if self.spec is None:
            return False
        limit = self.spec.disable_by_batch_size
        s = self.scheduler
        return limit is None or min(self.args.max_num_seqs,
                                    s.num_running + s.num_waiting) <= limit

    # ---- requests ---------------------------------------------------------------------
    def _make_device_structured(self, tokenizer: Any) -> Any:
        """Regular structured-output constraints (regex, choice, non-recursive JSON
        schema) run as automata inside the step (structured/device_compiler.py)."""
        from jaxserve.structured.device_compiler import DeviceCompiler, DeviceStructured
        return DeviceStructured(DeviceCompiler.for_tokenizer(
            tokenizer, self.eos_token_ids, self.model_cfg.vocab_size), self.runner.automata)

    @property
    def device_structured(self) -> Any:
        """The on-device automaton path (structured/device_compiler.DeviceStructured);
        None: every constraint takes the host path."""
        return self._device_structured

    @device_structured.setter
    def device_structured(self, dev: Any) -> None:
        self._device_structured = dev
        if self.scheduler.grammar is not None:   # regular constraints compile for it too
            self.scheduler.grammar.device = dev

    def add_request(self, request: Request) -> None:
        """Admit a request; raises ValueError (with a user-facing message) if it can never fit."""
        if not request.eos_token_ids:
            request.eos_token_ids = self.eos_token_ids
        if request.lora is not None and self.runner.lora_slots is None:
            raise ValueError("this engine serves no LoRA adapters (start it with "
                             "--enable-lora)")
        if request.sampling_params.pooled and self.pooling is None:
            raise ValueError("this model serves generation, not embeddings (start it "
                             "with --task embed)")
        dev = self.device_structured
        # with the host path's gate the device decision is made there, asynchronously
        # (structured/scheduling.py); without it, here (waiting for the compile)
        on_device = dev is not None and self.scheduler.grammar is None and dev.admit(request)
        if (not on_device and request.sampling_params.structured_outputs is not None
                and self.scheduler.grammar is None):
            raise ValueError("structured_outputs: this constraint cannot run on the device"
                             + (f" ({dev.last_fallback})" if dev is not None else
                                " (the engine has no tokenizer)"))
        try:
            # what the device does not take, the host path does (structured/scheduling.py)
            self.scheduler.add_request(request, host_grammar=not on_device)
        except Exception:
            if on_device:
                dev.release(request.request_id)
            raise

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(req_ids, FinishReason.ABORT)

    def finish_requests(self, req_ids: Iterable[str], reason: FinishReason) -> None:
        self.scheduler.finish_requests(req_ids, reason)

    # ---- the loop ---------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self._inflight is not None or self.scheduler.has_unfinished_requests()

    # One of three orders, bound to self.step at construction (StepConfig.host_order):
    # * async (--pipeline-steps --async-scheduling, the default): schedule and dispatch
    #   step N+1 first, its decode rows reading step N's tokens on the device, then
    #   collect step N and return its outputs. The device always has the next step
    #   queued while the host waits, updates and the caller detokenizes; the host learns
    #   each token one step later, so a request that stopped at step N got one extra
    #   step, whose token is dropped.
    # * pipelined (--no-async-scheduling): collect step N, schedule and dispatch N+1,
    #   return N's outputs while N+1 runs (the device idles while the host schedules).
    # * in turn (--no-pipeline-steps): schedule, execute, update.
    # Either way finishes the caller decides (stop strings, aborts) reach the scheduler
    # one step after the outputs they come from.
    def step_async(self) -> list[EngineCoreOutput]:
        """Run the engine one step (asynchronous order); the requests that changed."""
        prev = self._take_inflight()
        speculate = self._speculate_now()
        outs: list[EngineCoreOutput] = []
        if prev is not None and self._must_collect_first(prev[0], speculate):
            outs, prev = self._finish_step(prev[0], self.runner.collect(prev[1])), None
        so, failed = self._schedule(speculate, idle=prev is None)
        outs += failed
        if not so.is_empty:
            self._inflight = (so, self.runner.dispatch(so))
        if prev is not None:        # N+1 is queued, now wait for N
            outs += self._finish_step(prev[0], self.runner.collect(prev[1]))
        self._returned_at = time.perf_counter()
        return outs

    def step_pipelined(self) -> list[EngineCoreOutput]:
        """Run the engine one step (pipelined order); the requests that changed."""
        prev = self._take_inflight()
        speculate = self._speculate_now()
        outs: list[EngineCoreOutput] = []
        if prev is not None:
            outs = self._finish_step(prev[0], self.runner.collect(prev[1]))
        so, failed = self._schedule(speculate, idle=True)
        outs += failed
        if not so.is_empty:
            self._inflight = (so, self.runner.dispatch(so))
        self._returned_at = time.perf_counter()
        return outs

    def step_in_turn(self) -> list[EngineCoreOutput]:
        """Run the engine one step, schedule -> execute -> update."""
        so, outs = self._schedule(self._speculate_now(), idle=True)
        if not so.is_empty:
            outs += self._finish_step(so, self.runner.execute(so))
        return outs

    def _must_collect_first(self, prev: SchedulerOutput, speculate: bool) -> bool:
        """Whether the asynchronous order must collect the step in flight before
        scheduling the next: a speculating step's proposals come from each request's
        latest tokens, a verify step's accepted count (so num_computed_tokens) is known
        only on the host, and a constrained request's mask needs its latest token."""
        grammar = self.scheduler.grammar
        return (speculate or prev.kind is StepKind.VERIFY
                or (grammar is not None and grammar.active()))

    def _take_inflight(self) -> tuple[SchedulerOutput, Any] | None:
        prev, self._inflight = self._inflight, None
        if prev is not None:
            self.stats.overlapped_seconds += time.perf_counter() - self._returned_at
        return prev

    def _schedule(self, speculate: bool, idle: bool
                  ) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        """Schedule the next step; (it, the requests that failed outside a step). idle:
        no step is in flight, so waiting for a KV pull or a grammar costs no overlap."""
        ext = self.external_kv
        if ext is not None:
            ext.take_in(self.scheduler, idle)
        so = self.scheduler.schedule(speculate=True) if speculate else self.scheduler.schedule()
        if ext is not None:
            ext.before_dispatch()
        failed = self._failed_outputs()
        if so.is_empty and idle and self.scheduler.grammar is not None:
            self.scheduler.grammar.wait_compiling(0.05)     # only compiles to wait for
        if so.is_empty:     # finished / aborted diffs only: the runner still drops them
            self.runner.update_states(so)
        return so, failed

    def _finish_step(self, so: Any, result: Any) -> list[EngineCoreOutput]:
        self.stats.steps += 1
        self.stats.host_seconds += result.host_seconds
        self.stats.device_seconds += result.device_seconds
        self.stats.wait_seconds += result.wait_seconds
        self.stats.launch_seconds += result.launch_seconds
        self.stats.scheduled_tokens += so.total_num_scheduled_tokens
        self.stats.prompt_tokens += sum(
            n for rid, n in so.num_scheduled_tokens.items() if rid not in so.sampling_req_ids
        )
        updated = self.scheduler.update_from_output(so, result.sampled)
        if self.external_kv is not None:    # finished prefills read out before reuse
            self.external_kv.after_update()
        outs = []
        for req in updated:
            new = result.sampled.get(req.request_id, [])    # as appended (stops cut it)
            self.stats.generation_tokens += len(new)
            if req.finish_reason is not None:
                key = req.finish_reason.value
                self.stats.finished[key] = self.stats.finished.get(key, 0) + 1
            outs.append(EngineCoreOutput(
                req.request_id, new, req.finish_reason, req.stop_reason,
                _first(result.logprobs.get(req.request_id), len(new)),
                req.metrics.num_cached_tokens if req.metrics is not None else 0,
                error=req.error,
                prompt_logprobs=result.prompt_logprobs.get(req.request_id),
                pooled=result.pooled.get(req.request_id),
                stop_token=ends_on_stop_token(req, new)))
        return outs

    def _structured(self, args: EngineArgs, model_cfg: Any, tokenizer: Any
                    ) -> tuple[Any, int]:
        """Structured outputs: (the scheduler's grammar gate, the token bitmask width in
        int32 words), or (None, 0): not served. Multi-host runs do not serve them yet:
        every rank must build the same step inputs, and followers have no tokenizer."""
        if tokenizer is None or args.num_hosts > 1:
            return None, 0
        from jaxserve.structured.backend import GrammarBackend, words_per_row
        from jaxserve.structured.scheduling import GrammarGate
        backend = GrammarBackend(tokenizer, vocab_size=model_cfg.vocab_size,
                                 eos_token_ids=self.eos_token_ids)
        return GrammarGate(backend), words_per_row(model_cfg.vocab_size)

    def _failed_outputs(self) -> list[EngineCoreOutput]:
        """Requests that finished outside a step (their grammar failed to compile)."""
        failed, self.scheduler.failed = self.scheduler.failed, []
        return [EngineCoreOutput(r.request_id, [], r.finish_reason, error=r.error)
                for r in failed]

    @property
    def num_compiles(self) -> int:
        return self.runner.num_compiles

    def reset_prefix_cache(self) -> bool:
        """Forget the device prefix cache and the host tier (the disk tier stays)."""
        done = self.kv_manager.reset_prefix_cache()
        if done and self.external_kv is not None:
            self.external_kv.reset()
        return done

    def kv_transfer_params(self, transfer_id: str) -> dict[str, Any] | None:
        return self.kv_connector.advertise(transfer_id) if self.kv_connector else None

    def snapshot(self) -> EngineSnapshot:
        s, kv = self.scheduler, self.kv_manager
        sp = s.spec_stats
        return EngineSnapshot(
            num_running=s.num_running, num_waiting=s.num_waiting,
            num_preemptions=s.num_preemptions, num_blocks=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks, prefix_queries=kv.stats.queries,
            prefix_hits=kv.stats.hits, num_compiles=self.num_compiles, steps=self.stats.steps,
            spec_drafts=sp.num_drafts, spec_draft_tokens=sp.num_draft_tokens,
            spec_accepted_tokens=sp.num_accepted_tokens,
            spec_accepted_per_pos=tuple(sp.accepted_per_pos),
            running_loras=_lora_names(list(s.running)),
            waiting_loras=_lora_names(list(s.waiting)),
            **(self.external_kv.counters() if self.external_kv else {}))

    def shutdown(self) -> None:
        """The KV transfer endpoint closes; with a KV offload disk tier the device's
        cached blocks are written there; the structured-output compilers stop (the
        device path's compile child process is killed, not left to the garbage
        collector, as a hostile constraint can keep it busy for its whole deadline);
        the runner's device buffers go with the object."""
        ext: ExternalKV | None = getattr(self, "external_kv", None)
        if ext is not None:
            ext.close()
        dev = getattr(self, "_device_structured", None)
        if dev is not None:
            dev.compiler.shutdown()
        grammar = self.scheduler.grammar
        if grammar is not None:
            grammar.backend.shutdown()


def _lora_names(requests: list[Request]) -> tuple[str, ...]:
    """The distinct adapter names of these requests, sorted."""
    return tuple(sorted({r.lora_name for r in requests if r.lora_name is not None}))


def _first(entries: list | None, n: int) -> list | None:
    """The logprob entries of the tokens a request kept (a stop cuts a speculative
    step's tokens short)."""
    return entries if entries is None or len(entries) <= n else entries[:n]
