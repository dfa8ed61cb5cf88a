"""The async cluster client: block keys, prefix lookup, hedged erasure-coded reads, swap-in."""

from client.keys import block_keys
from client.kv_client import KVClient

__all__ = ["KVClient", "block_keys"]
