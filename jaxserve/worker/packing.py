"""One host->device transfer per step: every small input array packed into one int32 buffer.

A step's inputs are ~25 small arrays (tokens, attention metadata, sampling settings).
Sent one by one, each is its own host->device copy (on GPU: a DMA and its launch
latency, ~9 per step). Instead the host lays them end to end in one int32 numpy
buffer, in sections, with fixed offsets for a bucket:

    buf: | section "batch": tokens, positions, ..., block_tables | section "sampling": ... |
          int32 as is; float32 / uint32 bit-cast; bool as 0/1

and the jitted step slices it back into the same pytrees (slices and bit-casts: free).
The Layout (pytree structures, shapes, kinds, offsets) is static: it is the pytree
metadata of Packed, so jit keys its cache on it and a bucket always has the same one.
A section can be cut out on the device (`section`) and handed to another program
without knowing the rest of the buffer (the GPU's separate sampler program does).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from flax import struct
import jax
import jax.numpy as jnp
import numpy as np

_KINDS = {np.dtype(np.int32): "i", np.dtype(np.float32): "f", np.dtype(np.uint32): "u",
          np.dtype(bool): "b"}


@dataclasses.dataclass(frozen=True)
class Section:
    treedef: Any                                  # jax PyTreeDef (hashable)
    leaves: tuple[tuple[tuple[int, ...], str], ...]   # (shape, kind) per leaf
    offset: int                                   # first int32 word in the buffer
    size: int                                     # words

    def unpack(self, words: jax.Array) -> Any:
        """words: exactly this section's [size] int32 (device) -> the pytree."""
        out, at = [], 0
        for shape, kind in self.leaves:
            n = int(np.prod(shape, dtype=np.int64))
            x = words[at:at + n].reshape(shape)
            at += n
            if kind == "f":
                x = jax.lax.bitcast_convert_type(x, jnp.float32)
            elif kind == "u":
                x = jax.lax.bitcast_convert_type(x, jnp.uint32)
            elif kind == "b":
                x = x != 0
            out.append(x)
        return jax.tree_util.tree_unflatten(self.treedef, out)


@dataclasses.dataclass(frozen=True)
class Layout:
    sections: tuple[tuple[str, Section], ...]

    def __getitem__(self, name: str) -> Section:
        return dict(self.sections)[name]


@struct.dataclass
class Packed:
    """One step's inputs: buf [N] int32 (numpy on the host, then one device array) and
    its static layout."""
    buf: Any
    layout: Layout = struct.field(pytree_node=False)

    def unpack(self, name: str) -> Any:
        """In the jitted step: the pytree of section `name`."""
        sec = self.layout[name]
        return sec.unpack(self.buf[sec.offset:sec.offset + sec.size])

    def section(self, name: str) -> "Packed":
        """In the jitted step: a Packed holding only section `name` (offset 0)."""
        sec = self.layout[name]
        return Packed(self.buf[sec.offset:sec.offset + sec.size], self.section_layout(name))

    def section_layout(self, name: str) -> Layout:
        """The layout of section(name), without slicing the buffer."""
        return Layout(((name, dataclasses.replace(self.layout[name], offset=0)),))

    def to_device(self, sharding: Any = None) -> "Packed":
        """The step's one host->device transfer."""
        return Packed(jax.device_put(self.buf, sharding), self.layout)


def pack(**sections: Any) -> Packed:
    """Host: pytrees of numpy arrays (int32, float32, uint32, bool; None leaves are
    structure) -> one Packed int32 buffer, sections in keyword order."""
    words: list[np.ndarray] = []
    layout, offset = [], 0
    for name, tree in sections.items():
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        specs, start = [], offset
        for leaf in leaves:
            a = np.asarray(leaf)
            kind = _KINDS[a.dtype]
            flat = a.reshape(-1)
            words.append(flat.astype(np.int32) if kind == "b" else flat.view(np.int32))
            specs.append((tuple(a.shape), kind))
            offset += flat.size
        layout.append((name, Section(treedef, tuple(specs), start, offset - start)))
    buf = np.concatenate(words) if words else np.zeros(0, np.int32)
    return Packed(buf, Layout(tuple(layout)))
