"""An LMCache remote backend over a kvstore cluster: ``KVStoreConnectorAdapter`` (the URL
scheme ``kvstore://``) and its ``KVStoreRemoteConnector`` (LMCache's ``RemoteConnector``).

LMCache finds adapters outside its own package only through ``remote_storage_plugins``, so
the configuration names the plugin (docs/engine.md, "LMCache", has a whole file)::

    chunk_size: 256
    local_cpu: true                 # LMCache's remote backends need its CPU buffer
    max_local_cpu_size: 5
    remote_serde: naive
    remote_storage_plugins: ["kvstore"]
    extra_config:
      remote_storage_plugin.kvstore.module_path: engine_adapter.integrations.lmcache_backend
      remote_storage_plugin.kvstore.class_name: KVStoreConnectorAdapter
      remote_storage_plugin.kvstore.url: kvstore:///etc/kvstore/cluster.toml
      remote_storage_plugin.kvstore.tenant: acme
      remote_storage_plugin.kvstore.token_file: /etc/kvstore/acme.token
      remote_storage_plugin.kvstore.traffic_class: chat

``url`` (``kvstore://`` + the absolute path of cluster.toml) or ``cluster`` (the path) names
the cluster; the other ``remote_storage_plugin.kvstore.*`` keys are AdapterConfig's
(engine_adapter/integrations/adapter_config.py). LMCache's deprecated
``remote_url: kvstore:///...`` also works, with the same plugin lines: LMCache then builds a
second, plugin backend, which this adapter makes inert (it answers misses at once and stores
nothing) so each chunk is written and looked up once.

Each LMCache chunk (its ``MemoryObj`` bytes, ``remote_serde: naive``) is one store block,
keyed by the chunk key's string (model, world size, worker id, chunk hash, dtype) under a
namespace of the model, dtype, memory format and chunk shape, salted by the tenant. Chunk
hashes agree across processes only with ``PYTHONHASHSEED`` set, or a
``pre_caching_hash_algorithm`` other than "builtin" (LMCache's own caveat). Store failures
raise into LMCache's RemoteBackend, which counts them as misses and logs them.

Statistics where LMCache users look: LMCache wraps every remote connector, this one too, in
its ``InstrumentedRemoteConnector``, so reads and writes (requests, bytes, milliseconds)
land in its ``LMCStatsMonitor`` and its ``lmcache:`` Prometheus metrics; ``ping()`` answers
its remote-backend health check (latency, error code: 0, or the gRPC status code of the
failure) with one lookup.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlparse

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from client.sync_client import SyncKVClient
from engine_adapter.engine_keys import EngineKeyNamespace
from engine_adapter.integrations.adapter_config import PROBE_KEY, AdapterConfig
from kvstore.errors import KVStoreError
from kvstore.grpc_errors import status_code

log = logging.getLogger(__name__)

SCHEME = "kvstore://"
PLUGIN = "kvstore"
# remote_storage_plugin.<name>.* keys that LMCache itself or this module reads.
LMCACHE_KEYS = ("module_path", "class_name", "url")


class KVStoreRemoteConnector(RemoteConnector):
    """LMCache chunks as kvstore blocks, through the batch calls (see the module doc)."""

    def __init__(self, store_config: AdapterConfig, context: ConnectorContext) -> None:
        if store_config.kv_format != "dtype":  # LMCache's chunks are opaque bytes here
            raise ValueError(
                f"kv_format {store_config.kv_format!r} is not supported by the LMCache backend: "
                "it stores chunks as LMCache serialises them (choose LMCache's remote_serde); "
                "leave kv_format at 'dtype'"
            )
        metadata = context.metadata or context.local_cpu_backend.metadata
        super().__init__(context.config, metadata)
        self.local_cpu_backend = context.local_cpu_backend
        self.store_config = store_config
        shapes = "+".join("x".join(map(str, shape)) for shape in self.meta_shapes)
        self.namespace = EngineKeyNamespace(
            engine="lmcache",
            model=store_config.model_id or metadata.model_name,
            dtype="+".join(str(d).removeprefix("torch.") for d in self.meta_dtypes),
            layout=f"lmcache-{self.meta_fmt.name}-v1:{shapes}",
            page_tokens=metadata.chunk_size,
            extra=(("serde", str(context.config.remote_serde)),),
        )
        self.kv: SyncKVClient = store_config.connect()
        log.info(
            "kvstore LMCache backend: %s as tenant %s",
            store_config.cluster_toml,
            store_config.tenant,
        )

    def _store_keys(self, keys: Sequence[CacheEngineKey]) -> list[bytes]:
        return self.namespace.keys([key.to_string() for key in keys], self.store_config.tenant)

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A KVClient call on the client's loop, awaited from LMCache's loop."""
        return await asyncio.wrap_future(self.kv.submit(method, *args, **kwargs))

    async def exists(self, key: CacheEngineKey) -> bool:
        return (await self._call("contains", self._store_keys([key])))[0]

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self.kv.contains(self._store_keys([key]))[0]

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        return self.kv.match_prefix(self._store_keys(keys))

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        return await self._call("match_prefix", self._store_keys(keys))

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """One get_batch for all chunks; each lands in a buffer of LMCache's CPU backend."""
        blocks = await self._call("get_batch", self._store_keys(keys))
        return [None if block is None else self._memory_obj(block) for block in blocks]

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[CacheEngineKey]
    ) -> list[MemoryObj]:
        """The leading chunks that arrived (LMCache uses only a prefix)."""
        memory_objs = await self.batched_get(keys)
        leading = next((i for i, m in enumerate(memory_objs) if m is None), len(memory_objs))
        for memory_obj in memory_objs[leading:]:
            if memory_obj is not None:
                memory_obj.ref_count_down()
        return memory_objs[:leading]  # type: ignore[return-value]

    def _memory_obj(self, block: bytes) -> MemoryObj | None:
        if not 0 < len(block) <= self.full_chunk_size_bytes or len(block) % self.single_token_size:
            log.warning("a stored chunk of %d bytes does not fit this engine's chunks", len(block))
            return None
        memory_obj = self.local_cpu_backend.allocate(
            self.meta_shapes, self.meta_dtypes, self.meta_fmt
        )
        if memory_obj is None:  # LMCache's CPU buffer is full: a miss
            return None
        memoryview(memory_obj.byte_array).cast("B")[: len(block)] = block
        return self.reshape_partial_chunk(memory_obj, len(block))

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        views = [memoryview(m.byte_array).cast("B") for m in memory_objs]
        traffic_class = self.store_config.traffic_class
        await self._call("put_batch", self._store_keys(keys), views, traffic_class=traffic_class)

    def remove_sync(self, key: CacheEngineKey) -> bool:
        self.kv.delete(self._store_keys([key]))
        return True

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when the cluster answers a lookup, else the failure's gRPC status code (or 1)."""
        try:
            await self._call("contains", [PROBE_KEY])
        except (KVStoreError, OSError) as exc:
            log.warning("kvstore ping failed: %s", exc)
            return int(status_code(exc).value[0]) or 1
        return 0

    async def list(self) -> list[str]:
        """Not supported: the store has no listing of an engine's keys."""
        return []

    async def close(self) -> None:
        await asyncio.to_thread(self.kv.close)


class _InertConnector(RemoteConnector):
    """The duplicate plugin backend LMCache builds beside ``remote_url: kvstore://...``:
    misses at once, stores nothing (the URL backend does both)."""

    async def exists(self, key: CacheEngineKey) -> bool:
        return False

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return False

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        return 0

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        return 0

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return None

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[CacheEngineKey]
    ) -> list[MemoryObj]:
        return []

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        return None

    async def list(self) -> list[str]:
        return []

    async def close(self) -> None:
        return None


class KVStoreConnectorAdapter(ConnectorAdapter):
    """Makes LMCache's ``kvstore://`` and ``plugin://kvstore`` URLs into connectors."""

    def __init__(self) -> None:
        super().__init__(SCHEME)

    def can_parse(self, url: str) -> bool:
        """``kvstore://...``, or the plugin URL of a plugin named ``kvstore[.instance]``."""
        if url.startswith(SCHEME):
            return True
        return url.startswith("plugin://") and url.removeprefix("plugin://").split(".")[0] == PLUGIN

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        config = context.config
        plugin = context.plugin_name or PLUGIN
        if context.url.startswith("plugin://") and str(config.remote_url or "").startswith(SCHEME):
            metadata = context.metadata or context.local_cpu_backend.metadata
            return _InertConnector(config, metadata)
        settings = _plugin_settings(config.extra_config or {}, plugin)
        url = context.url if context.url.startswith(SCHEME) else settings.pop("url", None)
        if url is not None:
            settings.setdefault("cluster", _cluster_of(url))
        where = f"LMCache extra_config remote_storage_plugin.{plugin}.*"
        store_config = AdapterConfig.from_mapping(
            settings, where=where, known_elsewhere=LMCACHE_KEYS
        )
        return KVStoreRemoteConnector(store_config, context)


def _plugin_settings(extra_config: dict[str, Any], plugin: str) -> dict[str, Any]:
    prefix = f"remote_storage_plugin.{plugin}."
    return {k[len(prefix) :]: v for k, v in extra_config.items() if k.startswith(prefix)}


def _cluster_of(url: str) -> str:
    """``kvstore:///etc/kvstore/cluster.toml`` -> ``/etc/kvstore/cluster.toml``."""
    if not str(url).startswith(SCHEME):
        raise ValueError(f"a kvstore URL starts with {SCHEME}, got {url!r}")
    parsed = urlparse(url)
    return parsed.netloc + parsed.path
