"""The async cluster client: block keys, prefix lookup, hedged erasure-coded reads, swap-in."""

from client.keys import block_keys
from client.kv_client import KVClient
from client.read_outcome import BatchResult, Outcome
from client.sync_client import SyncKVClient

__all__ = ["BatchResult", "KVClient", "Outcome", "SyncKVClient", "block_keys"]
