"""vLLM's KV connector over a kvstore cluster, one concept a module.

::

    connector.py       KVStoreConnector: what vLLM calls, its config keys (the module doc)
    scheduler_side.py  lookups, load plans, save plans, stored-block reports (the scheduler)
    worker_side.py     loads into and saves out of the paged KV (each worker)
    metadata.py        what the scheduler hands the workers each step
    slices.py          the slice of each block a TP rank holds, and its key namespace
    stats.py           counters vLLM logs and exports to Prometheus
    events.py          KV events (``BlockStored``) for vLLM's publisher

vLLM loads it as ``engine_adapter.integrations.vllm_connector`` (docs/engine.md), which
re-exports the connector; ``engine_adapter.integrations.vllm.connector`` works as well.
Importing this package imports nothing of vLLM.
"""
