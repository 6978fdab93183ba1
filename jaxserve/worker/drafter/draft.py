"""Device drafters: proposals from a model on the device, for `self` and `draft_model`.

    {"method": "self", "draft_num_layers": L, "num_speculative_tokens": k}
        the target's first L layers + its final norm and head propose.
    {"method": "draft_model", "model": PATH, "num_speculative_tokens": k}
        another checkpoint with the target's vocabulary proposes.

Where the work happens in a speculating step (the engine has collected the step
before, so every speculating row's last token is on the host):

    Scheduler.schedule      DraftSlots: how many proposals each row verifies (k_r),
                            blocks allocated for them; values not known yet
    ModelRunner.dispatch    Drafter.propose: k one-token draft steps, one program
                            (draft_step.py); the host reads the k_r tokens per row
                            (the one extra round trip) and returns them; the runner
                            puts them into the SchedulerOutput; then the target
                            verifies them: greedy
                            and seeded rows by argmax matching (rejection.py: seeded
                            rows thus emit plain decoding's tokens), unseeded sampled
                            rows, whose proposals are draws from the draft's q, by the general
                            rule (rejection_general.py; q stays on the device, in the
                            step state's draft_probs)

KV of the draft:
* self: the draft's layer l (< L) is the target's layer l with the same inputs, so its
  KV at every computed position IS the target's: the draft reads and writes the
  target's own cache for layers < L, no extra memory and nothing to catch up. Its
  proposal steps write layers < L at positions p..p+k_r-1, which lie in the row's own
  blocks past its computed tokens; the verification step writes the same slots again
  (all layers) before anything reads them as computed, and a rejected tail is rolled
  back like any proposal's.
* draft_model: its own pool with the draft's geometry and the target's block ids (the
  KV manager stays the only owner of block tables). `mirror` runs the draft's layers
  over every target step's batch, so the pool holds what the target computed (prompt
  chunks, accepted tokens) at the same slots. Stale draft KV (e.g. blocks a KV
  transfer wrote into the target only) costs acceptance, never exactness.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.worker.packing import Packed
from jaxserve.worker.step_programs import StepState, head_weights
from jaxserve.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from jaxserve.worker.drafter.draft_inputs import (DraftRow, DraftShapes, build_draft_steps,
                                                  draft_sampling)
from jaxserve.worker.drafter.draft_step import DraftPrograms
from jaxserve.worker.drafter.protocol import Proposals

log = logging.getLogger("jaxserve")


class DraftSlots:
    """The scheduler's proposer for device drafters: it decides only how many tokens a
    row proposes (k within the scheduler's caps); the runner's Drafter fills in their
    values on the device before the step is built."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, req_id: str, prompt: list[int], output: list[int],
                max_k: int) -> list[int]:
        return [0] * min(self.k, max_k)

    def forget(self, req_id: str) -> None:
        pass


@dataclasses.dataclass(slots=True)
class DraftModel:
    """A draft checkpoint on the device: weights and its own KV pool."""
    cfg: Any
    weights: Any
    kv: Any


class DeviceDrafter:
    """A device drafter (worker/drafter/protocol.Drafter). It reads the runner's state
    (request states, block table, weights, KV, step state) and writes none of it."""

    def __init__(self, runner: Any, k: int, programs: DraftPrograms, *,
                 num_layers: int | None = None, model: DraftModel | None = None) -> None:
        """runner: the ModelRunner (its states, block table and, for self, weights and
        KV); exactly one of num_layers (self) and model (draft_model)."""
        assert (num_layers is None) != (model is None)
        self.runner, self.k, self.programs = runner, k, programs
        self.num_layers, self.model = num_layers, model
        self.shapes = DraftShapes.from_buckets(runner.buckets)

    def initial_draft_probs(self) -> Any:
        """q of every slot's proposals, [S, k, V] f32 in the step state (the verifying
        step reads its rows): S x k x V x 4 B, e.g. 65 x 4 x 49152 x 4 B = 51 MB."""
        r = self.runner
        q = jnp.zeros((r.pad_slot + 1, self.k, r.cfg.vocab_size), jnp.float32)
        return r.plan.replicate(q) if r.plan is not None else q

    # ---- the draft's weights and KV -----------------------------------------------------
    def _weights(self) -> dict:
        if self.model is not None:
            return self.model.weights
        w = self.runner.weights
        return {**head_weights(w), "layers": w["layers"][:self.num_layers]}

    def _kv(self) -> list:
        return self.model.kv if self.model is not None else self.runner.kv[:self.num_layers]

    def _keep_kv(self, kv: list) -> Any:
        """Store a draft model's KV (its own); for `self`, the runner's KV to adopt."""
        if self.model is not None:
            self.model.kv = kv
            return None
        return list(kv) + list(self.runner.kv[self.num_layers:])

    # ---- per step -------------------------------------------------------------------------
    def propose(self, so: Any) -> Proposals:
        """Values for the placeholder proposals in so.scheduled_spec_decode_tokens
        (greedy and seeded rows: the draft's argmax; others: draws from its q, which stays
        on the device for the verification) -- after the runner took the step's diff
        (block table and computed counts are current), before its step counter moves
        (the step's key)."""
        spec = so.scheduled_spec_decode_tokens
        r = self.runner
        if not spec:
            return Proposals({}, None, None)
        rows, states = [], []
        for rid, d in spec.items():
            st = r.states[rid]
            assert st.num_pending == 0 and len(st.token_ids) == st.num_computed_tokens + 1, \
                "a speculating row's last token must be on the host"
            rows.append(DraftRow(st.slot, st.num_computed_tokens, st.token_ids[-1], len(d)))
            states.append(st)
        props, kv, q = self._run(self._packed(rows, states))
        props = np.asarray(jax.device_get(props))            # [k, R]
        return Proposals({rid: [int(t) for t in props[:len(d), j]]
                          for j, (rid, d) in enumerate(spec.items())}, kv, q)

    def _packed(self, rows: list[DraftRow], states: list[Any],
                shape: tuple[int, int] | None = None) -> Packed:
        r = self.runner
        # `self` with adapters: the draft layers are the target's, run with each row's
        # adapter (its slot, placed before proposing); a draft model has no adapters
        lora = ([st.lora_slot for st in states]
                if self.model is None and r.lora_slots is not None else None)
        return build_draft_steps(
            rows, self.k, r.block_table, self.shapes, block_size=r.block_size,
            num_blocks=r.num_blocks, full_tables=r.backend.needs_full_block_tables,
            shape=shape, sampling=lambda R: draft_sampling(states, R, r.cfg.vocab_size,
                                                           r.pad_slot, r.step_count),
            lora_slots=lora).to_device(r._input_sharding)

    def _run(self, packed: Packed) -> tuple[Any, Any, Any]:
        """(proposals [k, R] on the device, the runner's KV to adopt or None, q)."""
        r = self.runner
        props, kv, q = self.programs.propose(self._weights(), self._kv(), packed,
                                             r.sampler_state.penalties,
                                             r.sampler_state.draft_probs, r.base_key)
        return props, self._keep_kv(kv), q

    def mirror(self, packed: Packed, sampler_state: Any) -> None:
        """draft_model: its layers over the target step's batch (before the target's
        step, which donates the sampler state the fed tokens are read from)."""
        if self.model is None:
            return
        self.model.kv = self.programs.mirror(self.model.weights, self.model.kv, packed,
                                             _last_tokens(sampler_state))

    # ---- warm-up ----------------------------------------------------------------------------
    def compile_propose(self) -> None:
        """The proposal program for every (rows, width) shape."""
        r = self.runner
        for shape in self.shapes.all():
            self.programs.propose.lower(self._weights(), self._kv(), self._packed([], [], shape),
                                        r.sampler_state.penalties,
                                        r.sampler_state.draft_probs, r.base_key).compile()

    def compile_mirror(self, packed: Packed, sampler_state: Any) -> None:
        """The mirror program for one target step shape (the runner's warm-up loop)."""
        if self.model is not None:
            self.programs.mirror.lower(self.model.weights, self.model.kv, packed,
                                       _last_tokens(sampler_state)).compile()


def _last_tokens(sampler_state: Any) -> Any:
    return sampler_state.last_tokens if isinstance(sampler_state, StepState) else None


def _kv_shardings(kv: Any, plan: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: a.sharding, kv) if plan is not None else None


def make_drafter(spec: SpeculativeConfig, runner: Any, *, dtype: Any, plan: Any,
                 kv_cache_dtype: str, max_model_len: int, tokenizer: Any = None
                 ) -> DeviceDrafter:
    """The drafter for a `self` or `draft_model` config, checked against the target
    (SpeculativeConfigError with a plain message when they do not fit)."""
    rep = plan.replicated() if plan is not None else None
    cfg = runner.cfg
    if spec.method == "self":
        L = spec.draft_num_layers
        assert L is not None
        if not 1 <= L < cfg.num_layers:
            raise SpeculativeConfigError(
                f"speculative_config.draft_num_layers: {L} must be in [1, "
                f"{cfg.num_layers - 1}] (the target has {cfg.num_layers} layers)")
        kv = runner.kv[:L]
        programs = DraftPrograms(cfg, runner.inv_freq, runner.backend.attn_fn,
                                 runner.count_compile, _kv_shardings(kv, plan), rep,
                                 branch=runner.branch)
        log.info("speculative decoding: self, the target's first %d of %d layers", L,
                 cfg.num_layers)
        return DeviceDrafter(runner, spec.num_speculative_tokens, programs, num_layers=L)
    model, attn_fn, inv_freq = _load_draft(spec, runner, dtype=dtype, plan=plan,
                                           kv_cache_dtype=kv_cache_dtype,
                                           max_model_len=max_model_len, tokenizer=tokenizer)
    programs = DraftPrograms(model.cfg, inv_freq, attn_fn, runner.count_compile,
                             _kv_shardings(model.kv, plan), rep, branch=runner.branch)
    return DeviceDrafter(runner, spec.num_speculative_tokens, programs, model=model)


def _load_draft(spec: SpeculativeConfig, runner: Any, *, dtype: Any, plan: Any,
                kv_cache_dtype: str, max_model_len: int, tokenizer: Any) -> tuple[DraftModel, Any, Any]:
    """Load the draft checkpoint, check it against the target, place it (same mesh)."""
    import jax.numpy as jnp
    from jaxserve.attention.backends import get_attention_backend
    from jaxserve.model import decoder
    from jaxserve.model.layers import rope_inv_freq
    from jaxserve.model.loader.load import load_model
    from jaxserve.model.loader.errors import CheckpointError
    from jaxserve.model.tokenizer.load import resolved
    try:
        loaded = load_model(spec.model, dtype=jnp.dtype(dtype).name, progress=False,
                            skip_tokenizer=tokenizer is None)
    except (CheckpointError, OSError) as e:
        raise SpeculativeConfigError(
            f"speculative_config.model: cannot load {spec.model!r}: {e}") from None
    dcfg, target = loaded.config, runner.cfg
    check_compatible(dcfg, loaded.tokenizer, target, resolved(tokenizer), max_model_len)
    dcfg = dataclasses.replace(dcfg, linear=target.linear)
    attn_fn = runner.backend.attn_fn
    if plan is not None:     # the same mesh and rules, the draft's own geometry
        from jaxserve.parallel.shard import ShardingPlan
        dplan = ShardingPlan.build(dcfg, plan.mesh, plan.rules, log_summary=False)
        dcfg = dplan.runtime_cfg
        weights = dplan.shard_weights(loaded.weights)
        kv = dplan.init_kv_cache(runner.num_blocks, runner.block_size, dtype, kv_cache_dtype)
        attn_fn = get_attention_backend(runner.backend.name, plan=dplan).attn_fn
    else:
        weights = loaded.weights
        kv = decoder.init_kv_cache(dcfg, runner.num_blocks, runner.block_size, dtype,
                                   kv_cache_dtype)
    log.info("speculative decoding: draft model %s (%d layers, hidden %d), own KV pool of "
             "%d blocks", loaded.source, dcfg.num_layers, dcfg.hidden_size, runner.num_blocks)
    if dcfg.cpu_matmul:     # the C++ kernel's layout, as the target's (model/cpu/matmul.py)
        from jaxserve.model.cpu.matmul import pack_weights
        weights = pack_weights(weights)
    return DraftModel(dcfg, weights, kv), attn_fn, jnp.asarray(rope_inv_freq(dcfg))


def check_compatible(draft_cfg: Any, draft_tok: Any, target_cfg: Any, target_tok: Any,
                     max_model_len: int) -> None:
    """A draft must share the target's vocabulary (ids mean the same tokens) and reach
    max_model_len; SpeculativeConfigError says which check failed."""
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise SpeculativeConfigError(
            f"speculative_config.model: the draft's vocabulary has {draft_cfg.vocab_size} "
            f"tokens, the target's {target_cfg.vocab_size}; a draft model must share the "
            f"target's vocabulary")
    if draft_tok is not None and target_tok is not None:
        dv, tv = draft_tok.get_vocab(), target_tok.get_vocab()
        if dv != tv:
            diff = sorted(set(dv.items()) ^ set(tv.items()))[:3]
            raise SpeculativeConfigError(
                f"speculative_config.model: the draft's tokenizer differs from the "
                f"target's (e.g. {diff}); a draft model must share the target's vocabulary")
    if draft_cfg.max_position_embeddings < max_model_len:
        raise SpeculativeConfigError(
            f"speculative_config.model: the draft reaches {draft_cfg.max_position_embeddings} "
            f"positions, less than max_model_len {max_model_len}")
