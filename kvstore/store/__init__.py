"""One node's shard store, synchronous: segment files, the lmdb index, reads and writes, expiry,
eviction, deletion, scrub steps and start-up recovery. No asyncio and no gRPC: the node
(kvstore/node/) wraps it in its executor.
"""
