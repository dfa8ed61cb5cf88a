"""The path vLLM loads the connector by (``kv_connector_module_path``, docs/engine.md).

The connector lives in ``engine_adapter/integrations/vllm/`` (its ``__init__`` lists the
modules); this module keeps the load string users already have working.
"""

from engine_adapter.integrations.vllm.connector import KVStoreConnector
from engine_adapter.integrations.vllm.events import KVStoreKVEvents
from engine_adapter.integrations.vllm.metadata import BlockTransfer, KVStoreConnectorMetadata
from engine_adapter.integrations.vllm.stats import KVStoreConnectorStats, KVStorePromMetrics

__all__ = [
    "BlockTransfer",
    "KVStoreConnector",
    "KVStoreConnectorMetadata",
    "KVStoreConnectorStats",
    "KVStoreKVEvents",
    "KVStorePromMetrics",
]
