"""A typed msgpack encoding of the scheduler's decisions, for sending them to other hosts.

Only registered dataclasses (SchedulerOutput and its parts, SamplingParams) and enums
are encoded, by name and field; decoding rebuilds exactly those types and nothing else
(no pickle: a peer can send data, never code). Sets and tuples keep their types, so a
decoded SchedulerOutput compares equal to the original. A new field of a plain type
needs nothing; a new dataclass or enum type must be `register`ed.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

import msgpack
import numpy as np

from jaxserve.sampling.params import RequestOutputKind, SamplingParams
from jaxserve.core.sched.output import (CachedRequestData, NewRequestData, SchedulerOutput,
                                        StepKind)

_DATACLASS, _SET, _TUPLE, _ENUM, _FROZENSET = 1, 2, 3, 4, 5
_TYPES: dict[str, type] = {}


class WireError(ValueError):
    """A message that is not a valid encoding of registered types."""


def register(*types: type) -> None:
    for t in types:
        if not (dataclasses.is_dataclass(t) or issubclass(t, enum.Enum)):
            raise TypeError(f"{t!r} is neither a dataclass nor an enum")
        _TYPES[t.__name__] = t


register(SchedulerOutput, NewRequestData, CachedRequestData, SamplingParams, RequestOutputKind,
         StepKind)


def _default(obj: Any) -> Any:
    t = type(obj)
    if isinstance(obj, (list, dict)):          # subclasses of plain containers
        return list(obj) if isinstance(obj, list) else dict(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, tuple):
        return msgpack.ExtType(_TUPLE, _pack(list(obj)))
    if isinstance(obj, frozenset):
        return msgpack.ExtType(_FROZENSET, _pack(sorted(obj, key=repr)))
    if isinstance(obj, set):
        return msgpack.ExtType(_SET, _pack(sorted(obj, key=repr)))
    if _TYPES.get(t.__name__) is t:
        if isinstance(obj, enum.Enum):
            return msgpack.ExtType(_ENUM, _pack([t.__name__, obj.value]))
        body = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
        return msgpack.ExtType(_DATACLASS, _pack([t.__name__, body]))
    raise TypeError(f"cannot send {t.__module__}.{t.__qualname__} to other hosts; "
                    f"register it in jaxserve/core/multihost/codec.py")


def _ext_hook(code: int, data: bytes) -> Any:
    value = _unpack(data)
    if code == _TUPLE:
        return tuple(value)
    if code == _SET:
        return set(value)
    if code == _FROZENSET:
        return frozenset(value)
    if code in (_DATACLASS, _ENUM):
        name, body = value
        t = _TYPES.get(name)
        if t is None:
            raise WireError(f"unknown type {name!r} in message")
        try:
            return t(body) if code == _ENUM else t(**body)
        except (TypeError, ValueError) as e:
            raise WireError(f"bad {name} in message: {e}") from None
    raise WireError(f"unknown msgpack extension {code}")


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, strict_types=True, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


def encode(obj: Any) -> bytes:
    return _pack(obj)


def decode(data: bytes) -> Any:
    try:
        return _unpack(data)
    except WireError:
        raise
    except Exception as e:   # msgpack's own errors: truncated or garbage input
        raise WireError(f"undecodable message: {e}") from None
