"""ShardingPlan: a mesh, the logical-axis rules, and the decisions that follow for one model.

    plan = ShardingPlan.build(model_cfg, make_mesh(tensor_parallel_size=4))
    weights = plan.shard_weights(host_weights)       # numpy or jax arrays -> sharded arrays
    kv = plan.init_kv_cache(num_blocks, block_size, dtype)   # sharded on KV heads

Per logical axis the plan decides once, for every array that has it: shard over the
rule's mesh axes when the axis's count divides by their size, else replicate (policy
`uneven: replicate`, logged) or refuse (`uneven: error`). Counts are in whole units —
heads, not columns — so a shard never splits a head: SmolLM2-135M (9 query heads, 3 KV
heads) shards attention at TP=3 and replicates it at TP=2/4/8, while its MLP (F=1536)
and vocabulary (49152) shard at every TP in {2, 3, 4, 8}.

Weights go straight into their shardings: each device receives only its slice, cut from
host numpy (jax.make_array_from_callback); the full array never sits on one device.
The model code stays sharding-free: jit propagates the input shardings (GSPMD).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.config import ConfigError
from jaxserve.attention import kv_layout as kv_layout_mod, kv_quant
from jaxserve.attention.kv_layout import HEAD_MAJOR, PAGE_MAJOR
from jaxserve.model.config import ModelConfig
from jaxserve.model.moe import ExpertPartition
from jaxserve.model.params import ParamSpec, is_spec, param_specs
from jaxserve.model.quant import is_quantized, matrix_axes, part_axes
from jaxserve.parallel.mesh import describe_mesh, make_mesh, mesh_shape_from, replica_meshes
from jaxserve.parallel.rules import ShardingRules, ShardingRulesError

log = logging.getLogger("jaxserve")

# Per-layer KV cache arrays are [K, num_blocks, block_size, H] (worker/kv_device.py);
# page-major ones [num_blocks, 2K, block_size, H] (attention/kv_layout.py) take the same
# rules with the first two axes swapped: 2K rows split contiguously over the TP axis
# give each device its heads' K and V rows ([2h, 2h + 1]) together.
KV_CACHE_AXES = ("kv_heads", "kv_blocks", "kv_slots", "head_dim")


@dataclass(frozen=True)
class AxisDecision:
    logical: str
    mesh_axes: tuple[str, ...]   # what the rule asks for
    count: int                   # units along the axis (heads, not columns)
    sharded: bool
    reason: str


class ShardingPlan:
    def __init__(self, cfg: ModelConfig, mesh: Mesh, rules: ShardingRules) -> None:
        self.cfg = cfg
        self.mesh = mesh
        self.rules = rules
        self.decisions = {a: self._decide(a, n) for a, n in self._axis_counts().items()}
        self.dropped = frozenset(a for a, d in self.decisions.items() if not d.sharded)
        self.specs = param_specs(cfg)
        # Resolving every spec up front runs the collision check on every array.
        self._param_shardings = jax.tree_util.tree_map(
            lambda s: self._sharding(s.logical_axes, _name(s)), self.specs, is_leaf=is_spec)
        # vLLM's answer to TP > K (query heads split wider than the KV heads): the cache
        # holds TP / K copies of each KV head, one per rank, and is split over the TP
        # axis like the query heads -- each device stores and writes only the head its
        # queries read (1/K of a replicated cache), and a kernel that writes the cache
        # itself (TPU) works unchanged. The model repeats k/v before the write.
        self.kv_head_replicas = self._kv_replicas()
        self.runtime_cfg = dataclasses.replace(cfg, kv_head_replicas=self.kv_head_replicas,
                                               moe_partition=self._moe_partition())
        self._kv_sharding = self._kv_cache_sharding()

    @classmethod
    def build(cls, cfg: ModelConfig, mesh: Mesh, rules: ShardingRules | None = None,
              *, log_summary: bool = True) -> "ShardingPlan":
        plan = cls(cfg, mesh, rules or ShardingRules.load())
        if log_summary:
            plan.log_summary()
        return plan

    # ---- decisions ------------------------------------------------------------------------
    def _axis_counts(self) -> dict[str, int]:
        c = self.cfg
        counts = {"vocab": c.vocab_size, "embed": c.hidden_size, "heads": c.num_heads,
                  "kv_heads": c.num_kv_heads, "ffn": c.intermediate_size,
                  "head_dim": c.head_dim}
        if c.num_experts:    # MoE: experts (EP) and each expert's hidden F (TP)
            counts.update(expert=c.num_experts, moe_ffn=c.moe_intermediate_size)
        return counts

    def _moe_partition(self) -> ExpertPartition | None:
        """Where the expert weights are split (model/moe.py runs the experts per device
        under shard_map and sums over these axes); None when nothing is split."""
        if not self.cfg.num_experts:
            return None
        split = {a: d.mesh_axes if d.sharded else () for a, d in self.decisions.items()}
        if not split["expert"] and not split["moe_ffn"]:
            return None
        return ExpertPartition(self.mesh, split["expert"], split["moe_ffn"])

    def _decide(self, logical: str, count: int) -> AxisDecision:
        axes = self.rules.mesh_axes_for(logical)
        size = int(np.prod([self.mesh.shape[a] for a in axes])) if axes else 1
        if size == 1:
            return AxisDecision(logical, axes, count, False,
                                "replicated (rule)" if not axes else "mesh axis of size 1")
        where = "+".join(axes)
        if count % size == 0:
            return AxisDecision(logical, axes, count, True,
                                f"sharded over {where} ({count}/{size} = {count // size} each)")
        msg = f"{logical}: {count} not divisible by {where} size {size}"
        if self.rules.uneven == "error":
            raise ShardingRulesError(f"{msg} (uneven: error in {self.rules.source})")
        return AxisDecision(logical, axes, count, False, f"replicated ({msg})")

    def _kv_replicas(self) -> int:
        heads, kv = self.decisions["heads"], self.decisions["kv_heads"]
        size, K = _size(self.mesh, heads.mesh_axes), self.cfg.num_kv_heads
        if heads.sharded and not kv.sharded and K < size and size % K == 0:
            return size // K
        return 1

    def _kv_cache_sharding(self) -> NamedSharding:
        if self.kv_head_replicas == 1:
            return self._sharding(KV_CACHE_AXES, "the KV cache")
        axes = self.decisions["heads"].mesh_axes
        return NamedSharding(self.mesh, PartitionSpec(axes[0] if len(axes) == 1 else axes,
                                                      None, None, None))

    @property
    def kv_heads_per_device(self) -> int:
        """KV heads one device stores (sizes the KV pool from a per-device budget)."""
        heads = self.cfg.num_kv_heads * self.kv_head_replicas
        axes = self._kv_sharding.spec[0] if len(self._kv_sharding.spec) else None
        return heads // (_size(self.mesh, _tuple(axes)) if axes is not None else 1)

    def _sharding(self, logical_axes: tuple[str | None, ...], name: str) -> NamedSharding:
        return NamedSharding(self.mesh, self.rules.spec(logical_axes, name=name,
                                                        dropped=self.dropped))

    # ---- shardings -------------------------------------------------------------------------
    def param_shardings(self) -> Any:
        """The weights pytree's structure with a NamedSharding per parameter."""
        return self._param_shardings

    def kv_sharding(self, kv_layout: str = HEAD_MAJOR) -> NamedSharding:
        """One cache array's sharding in the given layout (attention/kv_layout.py)."""
        if kv_layout == HEAD_MAJOR:
            return self._kv_sharding
        spec = tuple(self._kv_sharding.spec) + (None,) * (4 - len(self._kv_sharding.spec))
        return NamedSharding(self.mesh, PartitionSpec(spec[1], spec[0], *spec[2:]))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def lora_slot_shardings(self, key: str) -> dict[str, NamedSharding]:
        """The shardings of a projection's LoRA slot arrays (model/lora.py: a [in, S, r],
        b [S, r, out]), split like the base weight `key` so the delta needs no other
        communication than the base projection's: a column-parallel projection (q/k/v,
        gate/up: outputs split) splits b on its outputs and keeps a whole, each device
        computing its own output columns; a row-parallel one (o, down: inputs split)
        splits a on its inputs and keeps b whole, each device's partial shrink summed
        over the devices (small: [T, S * r]) before the expand."""
        spec = next(layer[key] for layer in self.specs["layers"] if key in layer)
        fin, fout = spec.logical_axes
        return {"a": self._sharding((fin, None, None), f"lora {key}.a"),
                "b": self._sharding((None, None, fout), f"lora {key}.b")}

    # ---- placement -------------------------------------------------------------------------
    def shard_weights(self, weights: Any) -> Any:
        """Place a weights pytree (numpy or jax arrays) with the plan's shardings; a
        quantized weight (model/quant.py) places each part by its own logical axes."""
        shardings = self.param_shardings()
        w_leaves, w_def = jax.tree_util.tree_flatten(weights, is_leaf=is_quantized)
        s_leaves, s_def = jax.tree_util.tree_flatten(shardings)
        spec_leaves = jax.tree_util.tree_leaves(self.specs, is_leaf=is_spec)
        if w_def != s_def:
            raise ValueError(f"weights do not match the model's parameter tree:\n{w_def}\n"
                             f"vs\n{s_def}")
        return jax.tree_util.tree_unflatten(
            w_def, [self._place_quantized(w, p) if is_quantized(w) else place(w, s)
                    for w, s, p in zip(w_leaves, s_leaves, spec_leaves)])

    def _place_quantized(self, w: Any, spec: ParamSpec) -> Any:
        shardings = self.quantized_shardings(w, spec)
        return self.mark_split(w.map_parts(lambda n, p: place(p, shardings[n])), shardings)

    def quantized_shardings(self, w: Any, spec: ParamSpec) -> dict[str, NamedSharding]:
        """Each part's sharding for a quantized weight (model/quant.py QArray, real or of
        abstract parts) of parameter `spec`, by the part's own logical axes."""
        rows, cols = matrix_axes(spec.logical_axes, spec.hf_transpose)

        def one(name: str, part: Any) -> NamedSharding:
            axes = part_axes(w.kind, name, rows, cols)
            ps = self.rules.spec(axes, name=f"{_name(spec)}:{name}", dropped=self.dropped)
            # a block-scale axis can be shorter than its column axis: replicate it
            # where its own length does not divide
            fit = [a if a is None or part.shape[i] % _size(self.mesh, _tuple(a)) == 0
                   else None for i, a in enumerate(ps)]
            return NamedSharding(self.mesh, PartitionSpec(*fit))
        return {n: one(n, p) for n, p in w.parts.items()}

    @staticmethod
    def mark_split(w: Any, shardings: dict[str, NamedSharding]) -> Any:
        """w with `split`, the mesh axes of its matrix's rows and columns (those of its
        values part), which a kernel under shard_map reads (model/linear.py)."""
        values = shardings.get("q", shardings.get("p"))
        ps = tuple(values.spec) + (None, None) if values is not None else (None, None)
        return type(w)(w.kind, w.parts, w.shape, w.dtype, w.act, (ps[0], ps[1]))

    def init_kv_cache(self, num_blocks: int, block_size: int, dtype: Any,
                      kv_cache_dtype: str = "auto", kv_layout: str = HEAD_MAJOR) -> list:
        """Zeroed per-layer (k, v), created directly in kv_sharding() on every device
        (int8 / fp8: attention/kv_quant.QuantizedKV, scales split like the values);
        page_major: per-layer (kv, None) (attention/kv_layout.py)."""
        shape = kv_layout_mod.cache_shape(kv_layout,
                                          self.cfg.num_kv_heads * self.kv_head_replicas,
                                          num_blocks, block_size, self.cfg.head_dim)
        zeros = jax.jit(lambda: kv_quant.init_layer(shape, kv_cache_dtype, dtype),
                        out_shardings=kv_quant.leaf_shardings(self.kv_sharding(kv_layout),
                                                              kv_cache_dtype))
        return [kv_layout_mod.layer(kv_layout, zeros) for _ in range(self.cfg.num_layers)]

    def replicate(self, tree: Any) -> Any:
        """Commit a pytree (e.g. sampler state) replicated on the plan's devices."""
        return jax.tree_util.tree_map(lambda x: place(x, self.replicated()), tree)

    def step_jit_kwargs(self, kv_cache_dtype: str = "auto",
                        kv_layout: str = HEAD_MAJOR) -> dict[str, Any]:
        """jit kwargs for the runner's step -> (outputs, kv, sampler_state): pin the state
        it returns, so every call sees the shardings of the first (no recompiles)."""
        leaf = kv_quant.leaf_shardings(self.kv_sharding(kv_layout), kv_cache_dtype)
        kv = [kv_layout_mod.layer(kv_layout, lambda: leaf)] * self.cfg.num_layers
        return {"out_shardings": (self.replicated(), kv, self.replicated())}

    def layerwise_jit_kwargs(self, kv_cache_dtype: str = "auto", kv_layout: str = HEAD_MAJOR
                             ) -> dict[str, dict[str, Any]]:
        """The same pinning for the layerwise step: activations between layers are
        replicated, each layer's KV keeps the cache sharding."""
        rep = self.replicated()
        kv = kv_quant.leaf_shardings(self.kv_sharding(kv_layout), kv_cache_dtype)
        k, v = kv_layout_mod.layer(kv_layout, lambda: kv)
        return {"embed": {"out_shardings": rep}, "layer": {"out_shardings": (rep, k, v)},
                "head": {"out_shardings": (rep, rep)}}

    def attention_partition(self) -> "AttentionPartition":
        """How a kernel attention call is split over the mesh (see shard_attention)."""
        axes = self._kv_sharding.spec[0] if len(self._kv_sharding.spec) else None
        return AttentionPartition(axes, kv_sharded=axes is not None)

    def shard_attention(self, attn_fn: Any, *, writes_kv: bool = False,
                        kv_layout: str = HEAD_MAJOR) -> Any:
        """attn_fn run per device under shard_map (a custom kernel has no partitioning
        rule: Mosaic refuses to lower, Triton would be gathered onto every device).

        KV cache split over the heads' axis (KV heads sharded, or duplicated TP / K
        times when TP > K): each device runs its query heads against its KV heads (GQA
        groups never straddle devices). Otherwise every device runs all heads
        (replicated in and out). Metadata is replicated. writes_kv: attn_fn returns
        (out, k_cache, v_cache) and the caches keep their specs. kv_layout page_major:
        the caches are (kv, None) and kv is split on its second (2K) axis.
        """
        return shard_attention(attn_fn, self.mesh, self.attention_partition(), writes_kv,
                               kv_layout)

    def replicas(self) -> list["ShardingPlan"]:
        """One plan per data-parallel row of the mesh (each a 1 x TP sub-mesh)."""
        return [ShardingPlan(self.cfg, m, self.rules) for m in replica_meshes(self.mesh)]

    # ---- reporting -------------------------------------------------------------------------
    def summary_lines(self) -> list[str]:
        lines = [f"mesh: {describe_mesh(self.mesh)}",
                 f"rules: {self.rules.describe()}"]
        lines += [f"  {d.logical}: {d.reason}" for d in self.decisions.values()]
        groups: dict[str, list[str]] = {}
        for path, spec in jax.tree_util.tree_flatten_with_path(self.specs, is_leaf=is_spec)[0]:
            s = self._sharding(spec.logical_axes, _name(spec))
            key = _short_path(path)
            groups.setdefault(f"{tuple(s.spec)}", []).append(key)
        lines.append("weights:")
        for spec, names in groups.items():
            shown = sorted(set(names))
            lines.append(f"  {spec}: {', '.join(shown)}")
        copies = (f", {self.cfg.num_kv_heads} KV heads x {self.kv_head_replicas} copies "
                  f"(one per rank)" if self.kv_head_replicas > 1 else "")
        lines.append(f"kv cache {KV_CACHE_AXES}: {tuple(self._kv_sharding.spec)}{copies}, "
                     f"{self.kv_heads_per_device} KV head(s) per device")
        return lines

    def log_summary(self) -> None:
        for line in self.summary_lines():
            log.info("sharding: %s", line)


@dataclass(frozen=True)
class AttentionPartition:
    axes: Any                  # mesh axis (or tuple) heads and KV cache are split over
    kv_sharded: bool           # False: nothing split, every device runs all heads


def _size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


def _tuple(a: Any) -> tuple[str, ...]:
    return (a,) if isinstance(a, str) else tuple(a)


def _shard_map(fn: Any, mesh: Mesh, in_specs: Any, out_specs: Any) -> Any:
    """jax.shard_map (jax >= 0.7) or the older experimental one; no replication checks
    (a pallas_call has no rule for them)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)
    from jax.experimental.shard_map import shard_map
    return shard_map(fn, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def shard_attention(attn_fn: Any, mesh: Mesh, part: AttentionPartition,
                    writes_kv: bool = False, kv_layout: str = HEAD_MAJOR) -> Any:
    """See ShardingPlan.shard_attention. The returned function has attn_fn's signature:
    (q [T, N, H], k_new, v_new [T, K, H], k_cache, v_cache [K, NB, bs, H], md, **kw);
    page-major: k_cache [NB, 2K, bs, H], v_cache None."""
    P = PartitionSpec
    rep = P()
    if part.kv_sharded:
        # cache: a prefix spec, so it fits a QuantizedKV's rank-3 scales too
        heads = P(None, part.axes, None)
        cache = P(None, part.axes) if kv_layout == PAGE_MAJOR else P(part.axes)
        in_specs = (heads, heads, heads, cache, cache, rep)
        out_specs = (heads, cache, cache) if writes_kv else heads
    else:
        in_specs, out_specs = (rep,) * 6, ((rep,) * 3 if writes_kv else rep)

    def wrapped(q, k_new, v_new, k_cache, v_cache, md, **kw):
        fn = _shard_map(lambda *a: attn_fn(*a, **kw), mesh, in_specs, out_specs)
        return fn(q, k_new, v_new, k_cache, v_cache, md)

    return wrapped


def place(x: Any, sharding: NamedSharding) -> jax.Array:
    """One array into `sharding`; from host numpy each device gets only its own slice.

    Across hosts each process cuts the slices of its own devices from its host copy;
    an array already in `sharding` (an orbax restore across hosts) is kept as it is.
    """
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if isinstance(x, jax.Array) and sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def per_device_bytes(tree: Any) -> dict[Any, int]:
    """Bytes each addressable device holds for a pytree of arrays."""
    out: dict[Any, int] = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


def _name(s: ParamSpec) -> str:
    return s.hf_name


def _short_path(path: tuple) -> str:
    """('layers', 3, 'wq') -> 'layers.*.wq' so the log lists each kind of weight once."""
    parts = []
    for k in path:
        if hasattr(k, "idx"):
            parts.append("*")
        else:
            parts.append(str(getattr(k, "key", k)))
    return ".".join(parts)


def spans_devices(plan: Any) -> bool:
    """Whether a step under `plan` is split over several devices. A one-device plan (a
    data-parallel replica at TP=1) partitions nothing, so the single-device paths (the
    CPU custom calls, which have no partitioning rule) stay open to it."""
    mesh = getattr(plan, "mesh", None)
    return plan is not None and (mesh is None or mesh.size > 1)


def mesh_and_rules_from_args(args: Any) -> tuple[Mesh, ShardingRules] | None:
    """The (data, model) mesh and rules EngineArgs ask for; None when one device suffices."""
    rules = ShardingRules.load(args.sharding_rules)
    if getattr(args, "enable_expert_parallel", False):
        rules = rules.expert_parallel()
    dp, tp = mesh_shape_from(args.tensor_parallel_size, args.data_parallel_size,
                             rules.mesh_section, rules.source)
    if dp * tp == 1 and args.num_hosts == 1:
        return None
    if args.num_hosts > 1:
        if dp > 1:
            raise ConfigError("data_parallel_size > 1 across hosts is not supported: run one "
                              "multi-host engine per replica behind a load balancer")
        if tp != jax.device_count():
            raise ConfigError(f"with --num-hosts {args.num_hosts}, tensor_parallel_size must "
                              f"use every device of every host ({jax.device_count()}), got {tp}")
    return make_mesh(tp, dp), rules


def plan_from_args(args: Any, cfg: ModelConfig) -> ShardingPlan | None:
    """The plan for ONE engine (EngineCore); data parallelism is core/data_parallel.py's."""
    found = mesh_and_rules_from_args(args)
    if found is None:
        return None
    mesh, rules = found
    if mesh.shape["data"] > 1:
        raise ConfigError("data_parallel_size > 1 needs the data-parallel front "
                          "(jaxserve.core.data_parallel.make_engine), not one EngineCore")
    return ShardingPlan.build(cfg, mesh, rules)
