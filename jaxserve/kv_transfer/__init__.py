"""KV transfer between engines (disaggregated prefill/decode).

config.py (--kv-transfer-config), blocks.py (jitted block gather/scatter on the device
cache), transport.py (the typed TCP stream, HMAC-authenticated; wire.py: its block data,
raw or int8), connector.py (the scheduler-side and worker-side duties). Importing the
package (config only) does not import jax; blocks.py and connector.py do.
"""
from jaxserve.kv_transfer.config import KVTransferConfig, parse_kv_transfer_config

__all__ = ["KVTransferConfig", "parse_kv_transfer_config"]
