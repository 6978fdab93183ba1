"""Pytree structures as JSON, for the stored step programs (worker/executables.py).

A stored program is a jax.export module over flat leaves; to give its callers the
pytrees they expect, its output structure is kept beside it. That structure holds
jaxserve's own node types (flax struct dataclasses) and their static metadata (a packed
input's Layout, which nests a PyTreeDef). This codec writes exactly those: builtin
containers, node types and dataclasses from jaxserve's own packages (looked up by name,
never anything else), and JSON scalars. Anything else raises Unencodable, and the
program is then compiled at every start instead of stored.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import jax
from jax.tree_util import PyTreeDef

# where node types and static dataclasses may come from
_PACKAGES = ("jaxserve.", "kernels_pallas.", "kernels_cpu.")
_BUILTIN: dict[str, type] = {"tuple": tuple, "list": list, "dict": dict, "None": type(None)}
_LEAF = jax.tree_util.tree_structure(0)


class Unencodable(ValueError):
    """A structure this codec does not write (a foreign node type or metadata)."""


def _name(t: type) -> str:
    for k, v in _BUILTIN.items():
        if t is v:
            return k
    if not t.__module__.startswith(_PACKAGES):
        raise Unencodable(f"node type {t.__module__}.{t.__qualname__}")
    return f"{t.__module__}:{t.__qualname__}"


def _type(name: str) -> type:
    if name in _BUILTIN:
        return _BUILTIN[name]
    mod, _, qual = name.partition(":")
    if not mod.startswith(_PACKAGES) or not qual:
        raise Unencodable(f"type {name!r} is not jaxserve's")
    obj: Any = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise Unencodable(f"{name!r} is not a type")
    return obj


def encode(td: PyTreeDef) -> Any:
    """A PyTreeDef -> JSON-able data (raises Unencodable)."""
    nd = td.node_data()
    if nd is None:
        return "*"
    t, aux = nd
    return [_name(t), _value(aux), [encode(c) for c in td.children()]]


def decode(data: Any) -> PyTreeDef:
    """The inverse of encode."""
    if data == "*":
        return _LEAF
    name, aux, children = data
    return PyTreeDef.from_node_data_and_children(
        jax.tree_util.default_registry, (_type(name), _unvalue(aux)),
        [decode(c) for c in children])


def _value(x: Any) -> Any:
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, tuple):
        return {"tuple": [_value(i) for i in x]}
    if isinstance(x, list):
        return {"list": [_value(i) for i in x]}
    if isinstance(x, PyTreeDef):
        return {"treedef": encode(x)}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {"dataclass": _name(type(x)),
                "fields": {f.name: _value(getattr(x, f.name)) for f in dataclasses.fields(x)}}
    raise Unencodable(f"metadata of type {type(x).__name__}")


def _unvalue(x: Any) -> Any:
    if not isinstance(x, dict):
        return x
    if "tuple" in x:
        return tuple(_unvalue(i) for i in x["tuple"])
    if "list" in x:
        return [_unvalue(i) for i in x["list"]]
    if "treedef" in x:
        return decode(x["treedef"])
    cls = _type(x["dataclass"])
    if not dataclasses.is_dataclass(cls):
        raise Unencodable(f"{x['dataclass']!r} is not a dataclass")
    return cls(**{k: _unvalue(v) for k, v in x["fields"].items()})
