"""LoRA requests and the host-side adapter registry.

    LoRARequest(lora_name, lora_int_id, lora_path)    vLLM's request object
    LoRARegistry                                      names -> adapters, host LRU cache

The registry knows the adapters the server offers by name (--lora-modules and runtime
loads) and keeps at most max_cpu_loras loaded adapters in host memory, least recently
used dropped first (a request keeps its own reference, so dropping never affects a
request already admitted). Loading reads and checks files (model/loader/peft.py): the
server calls it on a worker thread, never on the event loop or the engine thread.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from jaxserve.model.config import ModelConfig
from jaxserve.model.loader.peft import Adapter, AdapterError, load_adapter

__all__ = ["Adapter", "AdapterError", "LoRARequest", "LoRARegistry", "parse_lora_modules"]

MAX_NAME_CHARS = 256


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for one request (vLLM's fields): a name, a positive id, a local path."""
    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive int, got {self.lora_int_id!r}")
        if not self.lora_name or len(self.lora_name) > MAX_NAME_CHARS:
            raise ValueError(f"lora_name must be 1-{MAX_NAME_CHARS} characters")


def parse_lora_modules(items: list[Any] | None) -> list[tuple[str, str, str | None]]:
    """--lora-modules entries, each name=path or a JSON object {"name", "path",
    "base_model_name"} -> [(name, path, base_model_name)]; ValueError naming the entry."""
    out = []
    for item in items or []:
        if isinstance(item, dict):          # a mapping in a YAML file
            item = json.dumps(item)
        text = str(item).strip()
        if text.startswith("{"):
            try:
                obj = json.loads(text)
            except ValueError as e:
                raise ValueError(f"lora_modules: {item!r} is not valid JSON ({e})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) \
                    or not isinstance(obj.get("path"), str):
                raise ValueError(f"lora_modules: {item!r} needs string 'name' and 'path'")
            base = obj.get("base_model_name")
            out.append((obj["name"], obj["path"], base if isinstance(base, str) else None))
        else:
            name, sep, path = text.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules: {item!r} is not name=path")
            out.append((name, path, None))
    names = [n for n, _, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"lora_modules: a name appears twice in {names}")
    for n in names:
        if len(n) > MAX_NAME_CHARS:
            raise ValueError(f"lora_modules: name longer than {MAX_NAME_CHARS} characters")
    return out


class LoRARegistry:
    """Adapters by name, and the host cache of loaded ones (thread-safe)."""

    def __init__(self, cfg: ModelConfig, *, max_rank: int, max_cpu_loras: int) -> None:
        self.cfg, self.max_rank, self.max_cpu_loras = cfg, max_rank, max_cpu_loras
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()          # one load at a time (disk, memory)
        self._names: dict[str, LoRARequest] = {}
        self._cache: OrderedDict[tuple[str, int], Adapter] = OrderedDict()
        self._next_id = 1

    # ---- names -----------------------------------------------------------------------
    def requests(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._names.values())

    def lookup(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._names.get(name)

    def register(self, name: str, path: str, base_model_name: str | None = None
                 ) -> LoRARequest:
        """Load the adapter at path (checking it) and serve it as `name`; ValueError if
        the name is taken, AdapterError if the adapter is bad. Blocking: run it off the
        event loop."""
        with self._lock:
            if name in self._names:
                raise ValueError(f"an adapter named {name!r} is already loaded")
            lid = self._next_id
            self._next_id += 1
        req = LoRARequest(name, lid, path, base_model_name)
        self.get(req)                   # load and check now: a bad adapter is never listed
        with self._lock:
            if name in self._names:
                raise ValueError(f"an adapter named {name!r} is already loaded")
            self._names[name] = req
        return req

    def unregister(self, name: str) -> LoRARequest:
        """Stop serving `name` (KeyError if unknown); requests already admitted with it
        finish with it (they hold their adapter)."""
        with self._lock:
            req = self._names.pop(name)
            self._cache.pop((req.lora_path, req.lora_int_id), None)
            return req

    # ---- loaded adapters --------------------------------------------------------------
    def get(self, req: LoRARequest) -> Adapter:
        """The loaded adapter of a request (from the host cache, else read from disk).
        AdapterError for a bad adapter. Blocking on a miss."""
        key = (req.lora_path, req.lora_int_id)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        with self._load_lock:
            with self._lock:
                if key in self._cache:
                    return self._cache[key]
            adapter = load_adapter(req.lora_path, self.cfg, self.max_rank)
            with self._lock:
                self._cache[key] = adapter
                while len(self._cache) > self.max_cpu_loras:
                    self._cache.popitem(last=False)
            return adapter

    def cached(self) -> int:
        with self._lock:
            return len(self._cache)

