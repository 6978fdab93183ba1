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
    timeout           seconds a decode server gives a whole transfer (connect, handshake,
                      data) before it frees the transfer's blocks and recomputes
    ttl               seconds a prefill server keeps a saved prefill nobody pulled
    buffer_bytes      most bytes of saved prefills a prefill server holds at once
    secret_file       file with the transfer secret every prefill and decode server
                      shares (else env JAXSERVE_KV_TRANSFER_SECRET); required, and never
                      the --api-key: it signs the kv_transfer_params a prefill server
                      advertises and authenticates both ends of every transfer
    prefill_endpoints "host:port" transfer endpoints a decode server may pull from (empty:
                      any endpoint whose signed kv_transfer_params check out)
    max_loading_fraction  most of the KV pool that pending pulls may hold (over it a
                      request computes its prompt itself)
    handshake_timeout seconds a peer of the transfer endpoint has to authenticate
    max_peer_connections  connections one peer address may hold open on the transfer
                      endpoint (more are closed at once)
    wire_dtype        how a decode server asks for the blocks: "native" (the cache's own
                      bytes, exact) or "int8" (values + a scale per token and head:
                      about 1/4 of a float32 cache's bytes, rounded; kv_transfer/wire.py)
"""
from __future__ import annotations

import hmac
import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from jaxserve.kv_transfer.wire import WIRES

SECRET_ENV = "JAXSERVE_KV_TRANSFER_SECRET"
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
    prefill_endpoints: tuple[str, ...] = ()
    max_loading_fraction: float = 0.5
    handshake_timeout: float = 5.0
    max_peer_connections: int = 8

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
    if "prefill_endpoints" in data:
        data = {**data, "prefill_endpoints": _endpoints(data["prefill_endpoints"], where)}
    return KVTransferConfig(**data)


def _endpoints(value: Any, where: str) -> tuple[str, ...]:
    """["host:port", ...] -> the same, checked (a bracketed IPv6 host is allowed)."""
    if not isinstance(value, list):
        raise ValueError(f"{where}: prefill_endpoints must be a list of \"host:port\"")
    out = []
    for item in value:
        host, sep, port = item.rpartition(":") if isinstance(item, str) else ("", "", "")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"{where}: prefill_endpoints entry {item!r} is not host:port")
        out.append(endpoint(host, int(port)))
    return tuple(out)


def endpoint(host: str, port: int) -> str:
    """The one spelling of an endpoint both the allow-list and a request's params use."""
    host = host.strip("[]").lower()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_types(data: dict[str, Any], where: str) -> None:
    ints = {"kv_port": (0, 65535), "chunk_blocks": (1, 4096), "buffer_bytes": (1, 1 << 50),
            "max_peer_connections": (1, 1024)}
    for key, (lo, hi) in ints.items():
        v = data.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)
                              or not lo <= v <= hi):
            raise ValueError(f"{where}: {key} must be an integer in [{lo}, {hi}], got {v!r}")
    for key in ("timeout", "ttl", "handshake_timeout"):
        v = data.get(key)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)
                              or not 0 < v <= 86400):
            raise ValueError(f"{where}: {key} must be seconds in (0, 86400], got {v!r}")
    v = data.get("max_loading_fraction")
    if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)
                          or not 0 < v <= 1):
        raise ValueError(f"{where}: max_loading_fraction must be in (0, 1], got {v!r}")
    for key in ("kv_ip", "secret_file"):
        v = data.get(key)
        if v is not None and not isinstance(v, str):
            raise ValueError(f"{where}: {key} must be a string, got {v!r}")


def read_secret(cfg: KVTransferConfig, api_key: str | None) -> bytes:
    """The transfer secret: secret_file's content, else $JAXSERVE_KV_TRANSFER_SECRET.
    Required: with it a prefill server's advertised params and both ends of a transfer
    are authenticated. Never the API key, which every client holds."""
    if cfg.secret_file:
        try:
            secret = Path(cfg.secret_file).read_bytes().strip()
        except OSError as e:
            raise ValueError(f"--kv-transfer-config secret_file {cfg.secret_file}: "
                             f"{e.strerror}") from None
        if not secret:
            raise ValueError(f"--kv-transfer-config secret_file {cfg.secret_file} is empty")
    else:
        secret = os.environ.get(SECRET_ENV, "").strip().encode()
        if not secret:
            raise ValueError(f"--kv-transfer-config needs a transfer secret shared by the "
                             f"prefill and decode servers: secret_file in the config or "
                             f"the {SECRET_ENV} environment variable (not the API key)")
    if api_key and hmac.compare_digest(secret, api_key.strip().encode()):
        raise ValueError("the KV transfer secret must not be the API key (clients hold "
                         "that one); give the servers a separate secret")
    return secret
