"""Logical-axis rules: which mesh axes each logical axis of an array is sharded over.

Parameters name their dimensions with logical axes (model/params.py); the KV cache with
KV_CACHE_AXES (parallel/shard.py). A rule maps one logical axis to a tuple of mesh axes
(empty = replicated). The rules come from configs/sharding/default.yaml (or a user file):

    rules:
      heads: model
      embed: null
      batch: [data]
    uneven: replicate          # or "error"

`spec` turns an array's logical axes into a PartitionSpec and refuses (ShardingRulesError)
to put two dimensions of one array on the same mesh axis — a silent collision would
otherwise become an invalid or surprising sharding deep inside XLA.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml
from jax.sharding import PartitionSpec

from jaxserve.config import ConfigError

MESH_AXES = ("data", "model")
UNEVEN_POLICIES = ("replicate", "error")
DEFAULT_RULES_FILE = Path(__file__).resolve().parents[2] / "configs" / "sharding" / "default.yaml"

# The same rules as configs/sharding/default.yaml (a test keeps the two equal); used when
# the package is installed without the repository's configs/ folder.
BUILTIN_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data",), "vocab": ("model",), "embed": (), "heads": ("model",),
    "kv_heads": ("model",), "ffn": ("model",), "head_dim": (), "kv_blocks": (), "kv_slots": (),
    "expert": (), "moe_ffn": ("model",),
}


class ShardingRulesError(ConfigError):
    """Rules that cannot be applied: unknown mesh axis, collision, uneven split under 'error'."""


@dataclass(frozen=True)
class ShardingRules:
    rules: Mapping[str, tuple[str, ...]]
    uneven: str = "replicate"
    source: str = "built-in"
    mesh_axes: tuple[str, ...] = field(default=MESH_AXES)
    mesh_section: Mapping[str, int] | None = None     # optional `mesh: {data, model}` sizes

    def __post_init__(self) -> None:
        if self.uneven not in UNEVEN_POLICIES:
            raise ShardingRulesError(f"sharding rules ({self.source}): uneven must be one of "
                                     f"{list(UNEVEN_POLICIES)}, got {self.uneven!r}")
        for logical, axes in self.rules.items():
            bad = [a for a in axes if a not in self.mesh_axes]
            if bad:
                raise ShardingRulesError(
                    f"sharding rules ({self.source}): {logical!r} -> {bad}: unknown mesh "
                    f"axis; the mesh has {list(self.mesh_axes)}")
            if len(set(axes)) != len(axes):
                raise ShardingRulesError(
                    f"sharding rules ({self.source}): {logical!r} names a mesh axis twice")

    # ---- construction -----------------------------------------------------------------
    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "mapping") -> "ShardingRules":
        if not isinstance(data, Mapping) or not isinstance(data.get("rules"), Mapping):
            raise ShardingRulesError(f"sharding rules ({source}): expected a mapping with a "
                                     f"'rules:' section")
        unknown = set(data) - {"rules", "uneven", "mesh"}
        if unknown:
            raise ShardingRulesError(f"sharding rules ({source}): unknown key(s) {sorted(unknown)}")
        rules = {str(k): _as_axes(v, k, source) for k, v in data["rules"].items()}
        mesh = data.get("mesh")
        if mesh is not None and not isinstance(mesh, Mapping):
            raise ShardingRulesError(f"sharding rules ({source}): mesh must be a mapping like "
                                     f"{{data: 2, model: 4}}")
        return cls(rules, str(data.get("uneven", "replicate")), source, mesh_section=mesh)

    @classmethod
    def load(cls, path: str | Path | None = None) -> "ShardingRules":
        """Rules from a YAML file; None = configs/sharding/default.yaml (or the built-in copy)."""
        if path is None:
            if not DEFAULT_RULES_FILE.is_file():
                return cls(dict(BUILTIN_RULES))
            path = DEFAULT_RULES_FILE
        p = Path(path)
        if not p.is_file():
            raise ShardingRulesError(f"sharding rules file {p} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ShardingRulesError(f"sharding rules file {p} is not valid YAML: {e}") from None
        return cls.from_mapping(data, str(p))

    # ---- use ----------------------------------------------------------------------------
    def mesh_axes_for(self, logical: str | None) -> tuple[str, ...]:
        if logical is None:
            return ()
        if logical not in self.rules:
            raise ShardingRulesError(f"sharding rules ({self.source}) have no rule for logical "
                                     f"axis {logical!r}; add `{logical}: null` to replicate it")
        return self.rules[logical]

    def spec(self, logical_axes: Sequence[str | None], *, name: str = "array",
             dropped: frozenset[str] = frozenset()) -> PartitionSpec:
        """PartitionSpec for an array with these logical axes.

        `dropped` are logical axes the plan decided to replicate (uneven split); they
        are still checked for collisions, so a bad rule set fails whatever the sizes.
        """
        used: dict[str, str] = {}
        parts: list[Any] = []
        for logical in logical_axes:
            axes = self.mesh_axes_for(logical)
            for a in axes:
                if a in used:
                    raise ShardingRulesError(
                        f"sharding rules ({self.source}): {name} would put logical axes "
                        f"{used[a]!r} and {logical!r} both on mesh axis {a!r}")
                used[a] = logical  # type: ignore[assignment]
            if not axes or logical in dropped:
                parts.append(None)
            else:
                parts.append(axes[0] if len(axes) == 1 else tuple(axes))
        return PartitionSpec(*parts)

    def expert_parallel(self) -> "ShardingRules":
        """--enable-expert-parallel (vLLM's flag): MoE experts split whole over the mesh
        axes that otherwise split each expert's hidden F (the TP axis), F kept whole.
        Attention and dense layers keep their tensor-parallel rules."""
        axes = self.rules.get("moe_ffn") or self.rules.get("expert") or ("model",)
        return dataclasses.replace(self, rules={**self.rules, "expert": axes, "moe_ffn": ()},
                                   source=f"{self.source} + expert parallel")

    def describe(self) -> str:
        items = [f"{k}->{'+'.join(v) if v else 'replicated'}" for k, v in self.rules.items()]
        return f"{', '.join(items)} (uneven: {self.uneven}; from {self.source})"


def _as_axes(v: Any, key: Any, source: str) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    if isinstance(v, (list, tuple)) and all(isinstance(a, str) for a in v):
        return tuple(v)
    raise ShardingRulesError(f"sharding rules ({source}): {key!r} must be a mesh axis name, "
                             f"a list of them, or null; got {v!r}")
