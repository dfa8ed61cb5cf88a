from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShardStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MISS: _ClassVar[ShardStatus]
    HIT: _ClassVar[ShardStatus]
    CORRUPT: _ClassVar[ShardStatus]
MISS: ShardStatus
HIT: ShardStatus
CORRUPT: ShardStatus

class ShardPut(_message.Message):
    __slots__ = ("key", "shard", "written_at_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_AT_S_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    shard: bytes
    written_at_s: float
    def __init__(self, key: _Optional[bytes] = ..., shard: _Optional[bytes] = ..., written_at_s: _Optional[float] = ...) -> None: ...

class PutShardsRequest(_message.Message):
    __slots__ = ("tenant", "traffic_class", "shards", "expires_at_s", "repair", "ttl_s")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_S_FIELD_NUMBER: _ClassVar[int]
    REPAIR_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    traffic_class: str
    shards: _containers.RepeatedCompositeFieldContainer[ShardPut]
    expires_at_s: float
    repair: bool
    ttl_s: float
    def __init__(self, tenant: _Optional[str] = ..., traffic_class: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[ShardPut, _Mapping]]] = ..., expires_at_s: _Optional[float] = ..., repair: bool = ..., ttl_s: _Optional[float] = ...) -> None: ...

class PutShardsReply(_message.Message):
    __slots__ = ("num_stored", "num_superseded", "num_fenced")
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    NUM_SUPERSEDED_FIELD_NUMBER: _ClassVar[int]
    NUM_FENCED_FIELD_NUMBER: _ClassVar[int]
    num_stored: int
    num_superseded: int
    num_fenced: int
    def __init__(self, num_stored: _Optional[int] = ..., num_superseded: _Optional[int] = ..., num_fenced: _Optional[int] = ...) -> None: ...

class GetShardsRequest(_message.Message):
    __slots__ = ("tenant", "keys", "version", "ucx")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UCX_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    version: bytes
    ucx: UcxDelivery
    def __init__(self, tenant: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., version: _Optional[bytes] = ..., ucx: _Optional[_Union[UcxDelivery, _Mapping]] = ...) -> None: ...

class UcxDelivery(_message.Message):
    __slots__ = ("worker_address", "tag_base")
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TAG_BASE_FIELD_NUMBER: _ClassVar[int]
    worker_address: bytes
    tag_base: int
    def __init__(self, worker_address: _Optional[bytes] = ..., tag_base: _Optional[int] = ...) -> None: ...

class ShardResult(_message.Message):
    __slots__ = ("status", "shards")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    status: ShardStatus
    shards: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, status: _Optional[_Union[ShardStatus, str]] = ..., shards: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ReadBatchChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class GetShardsReply(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ShardResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ShardResult, _Mapping]]] = ...) -> None: ...

class ContainsRequest(_message.Message):
    __slots__ = ("tenant", "keys")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, tenant: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KeyVersions(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, versions: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ContainsReply(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[KeyVersions]
    def __init__(self, results: _Optional[_Iterable[_Union[KeyVersions, _Mapping]]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("tenant", "keys")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, tenant: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteReply(_message.Message):
    __slots__ = ("num_deleted",)
    NUM_DELETED_FIELD_NUMBER: _ClassVar[int]
    num_deleted: int
    def __init__(self, num_deleted: _Optional[int] = ...) -> None: ...

class PurgeRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class PurgeReply(_message.Message):
    __slots__ = ("node_id", "num_deleted", "bytes_erased")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_DELETED_FIELD_NUMBER: _ClassVar[int]
    BYTES_ERASED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    num_deleted: int
    bytes_erased: int
    def __init__(self, node_id: _Optional[str] = ..., num_deleted: _Optional[int] = ..., bytes_erased: _Optional[int] = ...) -> None: ...

class Tombstone(_message.Message):
    __slots__ = ("seq", "tenant", "key", "at_s")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    AT_S_FIELD_NUMBER: _ClassVar[int]
    seq: int
    tenant: str
    key: bytes
    at_s: float
    def __init__(self, seq: _Optional[int] = ..., tenant: _Optional[str] = ..., key: _Optional[bytes] = ..., at_s: _Optional[float] = ...) -> None: ...

class ListTombstonesRequest(_message.Message):
    __slots__ = ("after_seq", "limit")
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    after_seq: int
    limit: int
    def __init__(self, after_seq: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class ListTombstonesReply(_message.Message):
    __slots__ = ("tombstones", "last_seq")
    TOMBSTONES_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    tombstones: _containers.RepeatedCompositeFieldContainer[Tombstone]
    last_seq: int
    def __init__(self, tombstones: _Optional[_Iterable[_Union[Tombstone, _Mapping]]] = ..., last_seq: _Optional[int] = ...) -> None: ...

class TouchShardsRequest(_message.Message):
    __slots__ = ("tenant", "keys", "versions")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    versions: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, tenant: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., versions: _Optional[_Iterable[bytes]] = ...) -> None: ...

class TouchShardsReply(_message.Message):
    __slots__ = ("num_touched",)
    NUM_TOUCHED_FIELD_NUMBER: _ClassVar[int]
    num_touched: int
    def __init__(self, num_touched: _Optional[int] = ...) -> None: ...

class ListShardsRequest(_message.Message):
    __slots__ = ("group", "start_after", "limit")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    START_AFTER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    group: int
    start_after: bytes
    limit: int
    def __init__(self, group: _Optional[int] = ..., start_after: _Optional[bytes] = ..., limit: _Optional[int] = ...) -> None: ...

class ListedShard(_message.Message):
    __slots__ = ("tenant", "key", "version", "shard_index", "written_at_s", "expires_at_s", "traffic_class", "shard_bytes")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_AT_S_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_S_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    SHARD_BYTES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    key: bytes
    version: bytes
    shard_index: int
    written_at_s: float
    expires_at_s: float
    traffic_class: str
    shard_bytes: int
    def __init__(self, tenant: _Optional[str] = ..., key: _Optional[bytes] = ..., version: _Optional[bytes] = ..., shard_index: _Optional[int] = ..., written_at_s: _Optional[float] = ..., expires_at_s: _Optional[float] = ..., traffic_class: _Optional[str] = ..., shard_bytes: _Optional[int] = ...) -> None: ...

class ListShardsReply(_message.Message):
    __slots__ = ("shards", "next_after")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_AFTER_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ListedShard]
    next_after: bytes
    def __init__(self, shards: _Optional[_Iterable[_Union[ListedShard, _Mapping]]] = ..., next_after: _Optional[bytes] = ...) -> None: ...

class RepairHint(_message.Message):
    __slots__ = ("tenant", "key", "group")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    key: bytes
    group: int
    def __init__(self, tenant: _Optional[str] = ..., key: _Optional[bytes] = ..., group: _Optional[int] = ...) -> None: ...

class QueueRepairRequest(_message.Message):
    __slots__ = ("hints",)
    HINTS_FIELD_NUMBER: _ClassVar[int]
    hints: _containers.RepeatedCompositeFieldContainer[RepairHint]
    def __init__(self, hints: _Optional[_Iterable[_Union[RepairHint, _Mapping]]] = ...) -> None: ...

class QueueRepairReply(_message.Message):
    __slots__ = ("num_queued",)
    NUM_QUEUED_FIELD_NUMBER: _ClassVar[int]
    num_queued: int
    def __init__(self, num_queued: _Optional[int] = ...) -> None: ...

class InspectShardsRequest(_message.Message):
    __slots__ = ("tenant", "keys")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, tenant: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class InspectedShard(_message.Message):
    __slots__ = ("version", "shard_index", "shard_bytes", "traffic_class", "written_at_s", "last_access_s", "expires_at_s", "status")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHARD_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_AT_S_FIELD_NUMBER: _ClassVar[int]
    LAST_ACCESS_S_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_S_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    version: bytes
    shard_index: int
    shard_bytes: int
    traffic_class: str
    written_at_s: float
    last_access_s: float
    expires_at_s: float
    status: ShardStatus
    def __init__(self, version: _Optional[bytes] = ..., shard_index: _Optional[int] = ..., shard_bytes: _Optional[int] = ..., traffic_class: _Optional[str] = ..., written_at_s: _Optional[float] = ..., last_access_s: _Optional[float] = ..., expires_at_s: _Optional[float] = ..., status: _Optional[_Union[ShardStatus, str]] = ...) -> None: ...

class InspectedKey(_message.Message):
    __slots__ = ("shards",)
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[InspectedShard]
    def __init__(self, shards: _Optional[_Iterable[_Union[InspectedShard, _Mapping]]] = ...) -> None: ...

class InspectShardsReply(_message.Message):
    __slots__ = ("node_id", "now_s", "results")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NOW_S_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    now_s: float
    results: _containers.RepeatedCompositeFieldContainer[InspectedKey]
    def __init__(self, node_id: _Optional[str] = ..., now_s: _Optional[float] = ..., results: _Optional[_Iterable[_Union[InspectedKey, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClassStats(_message.Message):
    __slots__ = ("traffic_class", "blocks", "bytes", "hits", "misses", "expired", "evicted", "youngest_evicted_age_s")
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    YOUNGEST_EVICTED_AGE_S_FIELD_NUMBER: _ClassVar[int]
    traffic_class: str
    blocks: int
    bytes: int
    hits: int
    misses: int
    expired: int
    evicted: int
    youngest_evicted_age_s: float
    def __init__(self, traffic_class: _Optional[str] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., expired: _Optional[int] = ..., evicted: _Optional[int] = ..., youngest_evicted_age_s: _Optional[float] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("node_id", "epoch", "shards", "bytes", "capacity_bytes", "corrupt_shards", "classes", "segments", "hits", "misses", "used_bytes", "retention_caps", "erase_queued", "last_tombstone_seq", "index_bytes", "quarantined_bytes", "retired_versions", "repair", "pid", "filesystem_id", "filesystem_bytes", "evicted_blocks", "peer_removed_shards", "compacted_bytes", "dead_bytes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_SHARDS_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RETENTION_CAPS_FIELD_NUMBER: _ClassVar[int]
    ERASE_QUEUED_FIELD_NUMBER: _ClassVar[int]
    LAST_TOMBSTONE_SEQ_FIELD_NUMBER: _ClassVar[int]
    INDEX_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RETIRED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    REPAIR_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    FILESYSTEM_ID_FIELD_NUMBER: _ClassVar[int]
    FILESYSTEM_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEER_REMOVED_SHARDS_FIELD_NUMBER: _ClassVar[int]
    COMPACTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    shards: int
    bytes: int
    capacity_bytes: int
    corrupt_shards: int
    classes: _containers.RepeatedCompositeFieldContainer[ClassStats]
    segments: int
    hits: int
    misses: int
    used_bytes: int
    retention_caps: _containers.RepeatedCompositeFieldContainer[RetentionCap]
    erase_queued: int
    last_tombstone_seq: int
    index_bytes: int
    quarantined_bytes: int
    retired_versions: int
    repair: RepairStats
    pid: int
    filesystem_id: str
    filesystem_bytes: int
    evicted_blocks: int
    peer_removed_shards: int
    compacted_bytes: int
    dead_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., shards: _Optional[int] = ..., bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., corrupt_shards: _Optional[int] = ..., classes: _Optional[_Iterable[_Union[ClassStats, _Mapping]]] = ..., segments: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., used_bytes: _Optional[int] = ..., retention_caps: _Optional[_Iterable[_Union[RetentionCap, _Mapping]]] = ..., erase_queued: _Optional[int] = ..., last_tombstone_seq: _Optional[int] = ..., index_bytes: _Optional[int] = ..., quarantined_bytes: _Optional[int] = ..., retired_versions: _Optional[int] = ..., repair: _Optional[_Union[RepairStats, _Mapping]] = ..., pid: _Optional[int] = ..., filesystem_id: _Optional[str] = ..., filesystem_bytes: _Optional[int] = ..., evicted_blocks: _Optional[int] = ..., peer_removed_shards: _Optional[int] = ..., compacted_bytes: _Optional[int] = ..., dead_bytes: _Optional[int] = ...) -> None: ...

class RetentionCap(_message.Message):
    __slots__ = ("tenant", "traffic_class", "max_ttl_s")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    MAX_TTL_S_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    traffic_class: str
    max_ttl_s: float
    def __init__(self, tenant: _Optional[str] = ..., traffic_class: _Optional[str] = ..., max_ttl_s: _Optional[float] = ...) -> None: ...

class RepairStats(_message.Message):
    __slots__ = ("backlog_shards", "rebuilt_shards", "rebuilt_bytes", "read_bytes", "skipped_expiring", "unrecoverable", "fenced", "queued_hints", "passes", "led_groups", "waiting_shards", "at_risk_blocks", "backlog_bytes", "eta_s", "pending_groups", "ready")
    BACKLOG_SHARDS_FIELD_NUMBER: _ClassVar[int]
    REBUILT_SHARDS_FIELD_NUMBER: _ClassVar[int]
    REBUILT_BYTES_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_EXPIRING_FIELD_NUMBER: _ClassVar[int]
    UNRECOVERABLE_FIELD_NUMBER: _ClassVar[int]
    FENCED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_HINTS_FIELD_NUMBER: _ClassVar[int]
    PASSES_FIELD_NUMBER: _ClassVar[int]
    LED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    WAITING_SHARDS_FIELD_NUMBER: _ClassVar[int]
    AT_RISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_BYTES_FIELD_NUMBER: _ClassVar[int]
    ETA_S_FIELD_NUMBER: _ClassVar[int]
    PENDING_GROUPS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    backlog_shards: int
    rebuilt_shards: int
    rebuilt_bytes: int
    read_bytes: int
    skipped_expiring: int
    unrecoverable: int
    fenced: int
    queued_hints: int
    passes: int
    led_groups: _containers.RepeatedScalarFieldContainer[int]
    waiting_shards: int
    at_risk_blocks: int
    backlog_bytes: int
    eta_s: float
    pending_groups: int
    ready: bool
    def __init__(self, backlog_shards: _Optional[int] = ..., rebuilt_shards: _Optional[int] = ..., rebuilt_bytes: _Optional[int] = ..., read_bytes: _Optional[int] = ..., skipped_expiring: _Optional[int] = ..., unrecoverable: _Optional[int] = ..., fenced: _Optional[int] = ..., queued_hints: _Optional[int] = ..., passes: _Optional[int] = ..., led_groups: _Optional[_Iterable[int]] = ..., waiting_shards: _Optional[int] = ..., at_risk_blocks: _Optional[int] = ..., backlog_bytes: _Optional[int] = ..., eta_s: _Optional[float] = ..., pending_groups: _Optional[int] = ..., ready: bool = ...) -> None: ...

class UcxSessionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UcxSessionReply(_message.Message):
    __slots__ = ("session_id", "key", "expires_in_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    key: bytes
    expires_in_s: float
    def __init__(self, session_id: _Optional[bytes] = ..., key: _Optional[bytes] = ..., expires_in_s: _Optional[float] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("node_id", "epoch", "serving", "now_s", "ucx_worker_address", "state", "incarnation", "repair_ready", "local_socket", "boot_id", "last_tombstone_seq", "node_pid", "stream_port")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    NOW_S_FIELD_NUMBER: _ClassVar[int]
    UCX_WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REPAIR_READY_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_TOMBSTONE_SEQ_FIELD_NUMBER: _ClassVar[int]
    NODE_PID_FIELD_NUMBER: _ClassVar[int]
    STREAM_PORT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    serving: bool
    now_s: float
    ucx_worker_address: bytes
    state: str
    incarnation: int
    repair_ready: bool
    local_socket: str
    boot_id: str
    last_tombstone_seq: int
    node_pid: int
    stream_port: int
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., serving: bool = ..., now_s: _Optional[float] = ..., ucx_worker_address: _Optional[bytes] = ..., state: _Optional[str] = ..., incarnation: _Optional[int] = ..., repair_ready: bool = ..., local_socket: _Optional[str] = ..., boot_id: _Optional[str] = ..., last_tombstone_seq: _Optional[int] = ..., node_pid: _Optional[int] = ..., stream_port: _Optional[int] = ...) -> None: ...
