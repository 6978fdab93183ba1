"""Sharding over device meshes and hosts: mesh.py (meshes, multi-host start-up),
rules.py (logical axis -> mesh axis), shard.py (ShardingPlan: weights and KV placement)."""
from jaxserve.parallel.mesh import init_distributed, make_mesh, replica_meshes
from jaxserve.parallel.rules import ShardingRules, ShardingRulesError
from jaxserve.parallel.shard import (KV_CACHE_AXES, ShardingPlan, per_device_bytes, place,
                                     plan_from_args)

__all__ = ["init_distributed", "make_mesh", "replica_meshes", "ShardingRules",
           "ShardingRulesError", "KV_CACHE_AXES", "ShardingPlan", "per_device_bytes", "place",
           "plan_from_args"]
