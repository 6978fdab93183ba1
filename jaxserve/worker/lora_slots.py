"""The device slots of LoRA adapters (model/lora.py): which adapter is in which slot.

Slots 1..max_loras hold adapters, slot 0 stays zero (the base model). Before a step,
`slots_for` gives every adapter of the step a slot: one it already has, else a free
one, else the least recently used slot no row of this step needs; the scheduler admits
at most max_loras distinct adapters among running requests, so one is always found. A
new adapter is written into its slot by one small jitted program (slot index traced:
compiled once, at warm-up) that donates the slot arrays, so only the written slot moves
(a copy of every slot measured 2-4x slower, docs/benchmarks.md); the runtime orders the
write after the reads of a step still in flight, so asynchronous scheduling needs no
wait. Shapes never change.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model import lora as lora_model
from jaxserve.model.config import ModelConfig


class LoRASlots:
    def __init__(self, cfg: ModelConfig, weights: dict[str, Any], *, max_loras: int,
                 max_rank: int, dtype: Any, on_trace: Callable[[], None],
                 plan: Any = None) -> None:
        """Adds zeroed slot arrays to every layer of `weights` (in place: the runner's
        own tree), as layer["lora"]. plan: a parallel.ShardingPlan, or None (one
        device); with one, each slot array is split like the projection it adapts
        (ShardingPlan.lora_slot_shardings) and the slot write keeps those shardings."""
        self.cfg, self.max_loras, self.rank = cfg, max_loras, max_rank
        self.dtype = jnp.dtype(dtype)
        self.on_trace = on_trace
        layers = weights["layers"]
        slots = lora_model.init_slots(cfg, layers, max_loras + 1, max_rank, self.dtype)
        write_kwargs: dict[str, Any] = {}
        if plan is not None:
            shardings = [{key: plan.lora_slot_shardings(key) for key in entry}
                         for entry in slots]
            slots = jax.device_put(slots, shardings)
            write_kwargs["out_shardings"] = shardings
        else:
            device = _device_of(layers)
            if device is not None:
                slots = jax.device_put(slots, device)
        for layer, entry in zip(layers, slots):
            layer["lora"] = entry
        self._targets = [sorted(entry) for entry in slots]
        self._slot_of: OrderedDict[str, int] = OrderedDict()    # adapter key -> slot
        self._write = jax.jit(self._write_impl, donate_argnums=0, **write_kwargs)
        self.loads = 0              # adapters written into a slot (swaps included)

    def _write_impl(self, trees, slot, new):
        self.on_trace()
        return [{key: {"a": t["a"].at[:, slot].set(new[i][key]["a"].astype(t["a"].dtype)),
                       "b": t["b"].at[slot].set(new[i][key]["b"].astype(t["b"].dtype))}
                 for key, t in entry.items()} for i, entry in enumerate(trees)]

    def _host_tree(self, adapter: Any) -> list[dict[str, dict[str, np.ndarray]]]:
        """The adapter's A and B padded to max_rank, zeros for the targets it leaves."""
        shapes = lora_model.target_shapes(self.cfg)
        out = []
        for i, keys in enumerate(self._targets):
            entry = {}
            for key in keys:
                fin, fout = shapes[key]
                a = np.zeros((fin, self.rank), np.float32)
                b = np.zeros((self.rank, fout), np.float32)
                ab = adapter.weights.get((i, key)) if adapter is not None else None
                if ab is not None:
                    a[:, :ab[0].shape[1]] = ab[0]
                    b[:ab[1].shape[0]] = ab[1]
                entry[key] = {"a": a, "b": b}
            out.append(entry)
        return out

    def write(self, weights: dict[str, Any], slot: int, adapter: Any) -> None:
        """Write an adapter (None: zeros) into a slot, bypassing the slot map (the caller
        keeps it right: slots_for, warm-up, benchmarks)."""
        layers = weights["layers"]
        trees = [layer["lora"] for layer in layers]
        new = self._write(trees, jnp.int32(slot), self._host_tree(adapter))
        for layer, entry in zip(layers, new):
            layer["lora"] = entry

    def warmup(self, weights: dict[str, Any]) -> None:
        """Compile the slot write (rewriting slot 1 with zeros)."""
        self.write(weights, 1, None)

    def slots_for(self, weights: dict[str, Any], adapters: list[Any]) -> list[int]:
        """Each adapter's slot (None: 0, the base), loading those not in a slot."""
        needed = {a.key for a in adapters if a is not None}
        if len(needed) > self.max_loras:
            raise RuntimeError(f"{len(needed)} adapters in one step, max_loras "
                               f"{self.max_loras} (the scheduler admits no more)")
        out = []
        for a in adapters:
            if a is None:
                out.append(0)
                continue
            slot = self._slot_of.get(a.key)
            if slot is None:
                slot = self._free_slot(needed)
                self.write(weights, slot, a)
                self._slot_of[a.key] = slot
                self.loads += 1
            self._slot_of.move_to_end(a.key)
            out.append(slot)
        return out

    def _free_slot(self, needed: set[str]) -> int:
        taken = set(self._slot_of.values())
        for s in range(1, self.max_loras + 1):
            if s not in taken:
                return s
        for key, s in self._slot_of.items():         # least recently used first
            if key not in needed:
                del self._slot_of[key]
                return s
        raise RuntimeError("no adapter slot free")    # unreachable: len(needed) <= max_loras

    def resident(self) -> dict[str, int]:
        """adapter key -> slot, least recently used first."""
        return dict(self._slot_of)


def _device_of(layers: list[dict[str, Any]]) -> Any:
    """The device of the weights (committed arrays), or None (host weights)."""
    for leaf in jax.tree_util.tree_leaves(layers):
        if isinstance(leaf, jax.Array) and getattr(leaf, "committed", False):
            return next(iter(leaf.devices()))
    return None
