"""KV moving out of the device cache: between engines (disaggregated prefill/decode)
and to the offload tiers behind the prefix cache.

config.py (--kv-transfer-config), blocks.py (jitted block gather/scatter on the device
cache), transport.py (the typed TCP stream, HMAC-authenticated; wire.py: its block data,
raw or int8), connector.py (the scheduler-side and worker-side duties). offload.py
(--kv-offload-bytes / --kv-offload-dir: host and disk tiers), offload_tiers.py (the
tiers and the block file format), offload_copy.py (block rows to and from any cache
layout). Importing the package (config only) does not import jax; blocks.py,
connector.py, offload.py and offload_copy.py do.
"""
from jaxserve.kv_transfer.config import KVTransferConfig, parse_kv_transfer_config

__all__ = ["KVTransferConfig", "parse_kv_transfer_config"]
