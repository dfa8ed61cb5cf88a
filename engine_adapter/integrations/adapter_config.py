"""What the vLLM, SGLang and LMCache adapters read from their engine's config to reach a
cluster: which cluster, as which tenant, with which credentials, in which traffic class.

Each engine passes a JSON-like mapping of its own (vLLM's ``kv_connector_extra_config``,
SGLang's ``--hicache-storage-backend-extra-config``, LMCache's
``remote_storage_plugin.kvstore.*`` extra_config keys, prefix removed); the keys are the
same everywhere::

    cluster        path of the cluster's cluster.toml (required)
    tenant         the tenant whose blocks these are (default "default")
    traffic_class  the class new blocks are written with: their TTL (default "chat")
    token_file     file holding this client's token; without it $KVSTORE_TOKEN or the file
                   named by $KVSTORE_TOKEN_FILE (never cluster.toml, never the engine config:
                   engines log their configs)
    tls_cert_file, tls_key_file   client certificate for mutual TLS (or $KVSTORE_TLS_*)
    transport      "auto" | "grpc" | "ucx" | "local" | "stream" (KVClient.connect's; default
                   "auto": the local channel to this host's nodes, UCX where it reaches over
                   shared memory or RDMA, the stream channel to the rest, gRPC as the last)
    model_id       names the model in the key namespace instead of the engine's model path
                   (set it when replicas load one model from different paths)
    kv_format      "dtype" (default: the engine's KV bytes as they are, fp8 caches included)
                   or "e4m3x16" (per-16 FP8, engine_adapter/kv_format.py); see
                   :meth:`AdapterConfig.stored_kv_format` for where it applies

No torch and no engine here: the adapters' own modules import their engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from client.landing_pool import LandingPool
from client.sync_client import SyncKVClient
from engine_adapter.kv_layout import E4M3X16_ENCODING
from kvstore.auth import read_token_file
from kvstore.config import READ_TRANSPORTS
from kvstore.errors import KVStoreError, PermissionDenied

log = logging.getLogger(__name__)

_FIELD_OF_KEY = {
    "cluster": "cluster_toml",
    "tenant": "tenant",
    "traffic_class": "traffic_class",
    "token_file": "token_file",
    "tls_cert_file": "tls_cert_file",
    "tls_key_file": "tls_key_file",
    "transport": "transport",
    "model_id": "model_id",
    "kv_format": "kv_format",
}
KV_FORMATS = ("dtype", "e4m3x16")  # engine_adapter.config's (no torch here)
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2", "uint8")  # caches that are fp8 already
ADAPTER_KEYS = frozenset(_FIELD_OF_KEY)
PROBE_KEY = bytes(16)  # looked up once at connect: the nodes check the credential
CREDENTIAL_GRACE_S = 3.0  # how long a refused credential is retried at connect


@dataclass(frozen=True)
class AdapterConfig:
    """How an engine adapter connects (keys as in the module doc). Validated on creation."""

    cluster_toml: str = ""  # required: __post_init__ says how to get one
    tenant: str = "default"
    traffic_class: str = "chat"
    token_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    transport: str = "auto"
    model_id: str | None = None
    kv_format: str = "dtype"
    where: str = "the adapter config"  # names the engine's config in error messages

    def __post_init__(self) -> None:
        if not isinstance(self.cluster_toml, str) or not self.cluster_toml:
            raise ValueError(
                f"{self.where} needs 'cluster': the path of the cluster's cluster.toml "
                "(written by `kvstore cluster up --dir DIR` as DIR/cluster.toml)"
            )
        for name in ("tenant", "traffic_class"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{self.where}: {name!r} must be a non-empty string")
        if self.kv_format not in KV_FORMATS:
            raise ValueError(
                f"{self.where}: kv_format {self.kv_format!r} is not one of {KV_FORMATS}"
            )
        if self.transport not in READ_TRANSPORTS:
            raise ValueError(
                f"{self.where}: transport {self.transport!r} is not one of {READ_TRANSPORTS}"
            )

    def stored_kv_format(self, cache_dtype: str, *, quantizes: bool = False) -> str:
        """What the adapter stores for an engine KV cache of ``cache_dtype``, as the key
        namespace's dtype names it: an fp8 cache (vLLM ``kv_cache_dtype=fp8_e4m3``) is stored
        as its bytes are, whatever kv_format says (it is already about half of bf16);
        e4m3x16 of a bf16, fp16 or fp32 cache is ``E4M3X16_ENCODING`` where the adapter's copy
        path quantises (``quantizes``: the vLLM connector's and the SGLang backend's), else it
        raises with the alternatives."""
        if self.kv_format == "dtype" or cache_dtype in FP8_DTYPES:
            return cache_dtype
        if quantizes:
            return E4M3X16_ENCODING
        raise ValueError(
            f"{self.where}: kv_format 'e4m3x16' with a {cache_dtype} KV cache is not supported "
            "by this adapter (the vLLM connector and SGLang backend quantise); run the engine "
            "with an fp8 KV cache (--kv-cache-dtype fp8_e4m3, stored as is) or leave "
            "kv_format at 'dtype'"
        )

    @classmethod
    def from_mapping(
        cls,
        mapping: Mapping[str, Any],
        *,
        where: str,
        known_elsewhere: Iterable[str] = (),
        strict: bool = True,
    ) -> AdapterConfig:
        """The config from an engine's mapping. ``known_elsewhere``: keys the engine or the
        adapter itself reads. With ``strict``, any other key raises ValueError (a typo would
        otherwise silently fall back to a default); SGLang shares its mapping with its own
        keys, so its adapter is not strict."""
        if "token" in mapping:
            raise ValueError(
                f"{where} has a 'token': engines log their configs, so a token must not be "
                "in one. Put it in a file readable only by you and name it with 'token_file', "
                "or set $KVSTORE_TOKEN / $KVSTORE_TOKEN_FILE"
            )
        unknown = set(mapping) - ADAPTER_KEYS - set(known_elsewhere)
        if unknown:
            message = f"{where} has unknown keys {sorted(unknown)}; known: {sorted(ADAPTER_KEYS)}"
            if strict:
                raise ValueError(message)
            log.warning("%s (ignored)", message)
        fields = {_FIELD_OF_KEY[key]: mapping[key] for key in ADAPTER_KEYS & set(mapping)}
        return cls(**fields, where=where)

    def connect(self, landing_pool: LandingPool | None = None) -> SyncKVClient:
        """A SyncKVClient for this tenant, its credential checked at once; ``landing_pool``:
        the engine's buffers the local nodes write into (client/landing_pool.py).

        Raises UnknownTrafficClass when the cluster lacks the class, and PermissionDenied
        (with the fix) when the nodes refuse the credential: an engine must not start and
        then miss on every lookup. A cluster that does not answer yet is logged only: the
        engine starts, and its lookups miss until the nodes are back.
        """
        token = read_token_file(self.token_file) if self.token_file else None
        kv = SyncKVClient.connect(
            self.cluster_toml,
            self.tenant,
            token,
            transport=self.transport,
            tls_cert_file=self.tls_cert_file,
            tls_key_file=self.tls_key_file,
            landing_pool=landing_pool,
        )
        try:
            kv.client.config.ttl.classes.check(self.traffic_class)
            self._check_credential(kv)
        except BaseException:
            kv.close()
            raise
        return kv

    def _check_credential(self, kv: SyncKVClient) -> None:
        # Nodes re-read the credentials file about once a second: a token added just before
        # the engine started may be refused for a moment, so a refusal is retried briefly.
        deadline_s = time.monotonic() + CREDENTIAL_GRACE_S
        while True:
            try:
                kv.contains([PROBE_KEY])
                return
            except PermissionDenied as exc:
                if time.monotonic() < deadline_s:
                    time.sleep(0.2)
                    continue
                raise PermissionDenied(
                    f"{self.where}: the cluster refused the credential for tenant "
                    f"{self.tenant!r} ({exc}). Name a file holding this tenant's token (or a "
                    "service token allowed to act for it) with 'token_file', or set "
                    "$KVSTORE_TOKEN / $KVSTORE_TOKEN_FILE (`kvstore cluster add-tenant` makes one)"
                ) from None
            except (KVStoreError, OSError) as exc:
                log.warning(
                    "kvstore cluster %s did not answer at start-up (%s): lookups miss until "
                    "it does",
                    self.cluster_toml,
                    exc,
                )
                return
