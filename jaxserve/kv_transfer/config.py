"""KVTransferConfig: `--kv-transfer-config '{"kv_role": "kv_producer", ...}'` (vLLM's flag).

    kv_role           kv_producer (a prefill server: saves finished prefills for pulling),
                      kv_consumer (a decode server: loads KV named in a request's
                      kv_transfer_params), kv_both (either, per request)
    kv_ip             the address this server advertises for its transfer endpoint
                      (default: the server's --host); a decode server connects to it
    kv_port           the transfer endpoint's TCP port (0: any free port, advertised)
    kv_connector      "TcpConnector" (the only one; vLLM's key, kept for its configs)
    chunk_blocks      blocks per jitted gather/scatter (one fixed shape each, compiled
                      at start-up)
    timeout           seconds a decode server waits on a transfer before recomputing
    ttl               seconds a prefill server keeps a saved prefill nobody pulled
    buffer_bytes      most bytes of saved prefills a prefill server holds at once
    secret_file       file with the secret both sides share (default: --api-key's value);
                      with neither, transfers are not authenticated (bind loopback or a
                      private network)
    wire_dtype        how a decode server asks for the blocks: "native" (the cache's own
                      bytes, exact) or "int8" (values + a scale per token and head:
                      about 1/4 of a float32 cache's bytes, rounded; kv_transfer/wire.py)
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from jaxserve.kv_transfer.wire import WIRES

ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("TcpConnector",)


@dataclass(slots=True, frozen=True)
class KVTransferConfig:
    kv_role: str
    kv_ip: str | None = None
    kv_port: int = 0
    kv_connector: str = "TcpConnector"
    chunk_blocks: int = 16
    timeout: float = 30.0
    ttl: float = 60.0
    buffer_bytes: int = 1 << 30
    secret_file: str | None = None
    wire_dtype: str = "native"

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


def parse_kv_transfer_config(text: str | dict[str, Any]) -> KVTransferConfig:
    """JSON text (or a dict) -> KVTransferConfig; ValueError naming the bad key."""
    where = "--kv-transfer-config"
    if isinstance(text, str):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{where}: not valid JSON ({e})") from None
    else:
        data = text
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must be a JSON object like "
                         f"{{\"kv_role\": \"kv_producer\"}}")
    known = {f.name: f for f in fields(KVTransferConfig)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")
    if data.get("kv_role") not in ROLES:
        raise ValueError(f"{where}: kv_role must be one of {list(ROLES)}, "
                         f"got {data.get('kv_role')!r}")
    if data.get("kv_connector", "TcpConnector") not in CONNECTORS:
        raise ValueError(f"{where}: kv_connector must be one of {list(CONNECTORS)}")
    _check_types(data, where)
    if data.get("wire_dtype", "native") not in WIRES:
        raise ValueError(f"{where}: wire_dtype must be one of {list(WIRES)}, "
                         f"got {data.get('wire_dtype')!r}")
    return KVTransferConfig(**data)


def _check_types(data: dict[str, Any], where: str) -> None:
    ints = {"kv_port": (0, 65535), "chunk_blocks": (1, 4096), "buffer_bytes": (1, 1 << 50)}
    for key, (lo, hi) in ints.items():
        v = data.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)
                              or not lo <= v <= hi):
            raise ValueError(f"{where}: {key} must be an integer in [{lo}, {hi}], got {v!r}")
    for key in ("timeout", "ttl"):
        v = data.get(key)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)
                              or not 0 < v <= 86400):
            raise ValueError(f"{where}: {key} must be seconds in (0, 86400], got {v!r}")
    for key in ("kv_ip", "secret_file"):
        v = data.get(key)
        if v is not None and not isinstance(v, str):
            raise ValueError(f"{where}: {key} must be a string, got {v!r}")
