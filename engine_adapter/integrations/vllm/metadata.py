"""What the scheduler side hands the workers each step: the blocks to load and to save."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True)
class BlockTransfer:
    """Blocks of one request to load or save: vLLM block hashes and the paged block ids
    (saves also carry what a ``BlockStored`` event names: the parent hash and the tokens)."""

    req_id: str
    block_hashes: list[bytes]
    salt: bytes  # tenant and cache_salt (engine_adapter/engine_keys.py)
    block_ids: list[int]
    parent_hash: bytes | None = None
    token_ids: list[int] = field(default_factory=list)


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
