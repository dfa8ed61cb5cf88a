"""KV events: a ``BlockStored`` (medium STORAGE) per saved block, for vLLM's publisher."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockStored, KVConnectorKVEvents

from engine_adapter.integrations.vllm.metadata import BlockTransfer

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent


class KVStoreKVEvents(KVConnectorKVEvents):
    """``BlockStored`` events of one step, from one or (after vLLM merges them) all workers."""

    def __init__(self, events: list[KVCacheEvent] | None = None, num_workers: int = 1) -> None:
        self.events = list(events or [])
        self.num_workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self.events += events

    def aggregate(self) -> KVStoreKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.num_workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self.events)

    def get_number_of_workers(self) -> int:
        return self.num_workers

    def clear_events(self) -> None:
        self.events = []


def stored_events(transfer: BlockTransfer, block_size: int) -> list[BlockStored | None]:
    """One BlockStored per saved block (parent: the block before it); none for loads."""
    if not transfer.token_ids:
        return [None] * len(transfer.block_hashes)
    parents = [transfer.parent_hash, *transfer.block_hashes[:-1]]
    return [
        BlockStored(
            block_hashes=[block_hash],
            parent_block_hash=parent,
            token_ids=transfer.token_ids[i * block_size : (i + 1) * block_size],
            block_size=block_size,
            lora_id=None,
            medium=MEDIUM_STORAGE,
            lora_name=None,
        )
        for i, (block_hash, parent) in enumerate(zip(transfer.block_hashes, parents, strict=True))
    ]
