"""Cluster configuration: one frozen dataclass per concern, loaded from one TOML file.

``cluster.toml`` is the single source of truth for nodes, clients and tools::

    epoch = 1                      # bumped whenever the map changes
    [codec]
    k = 10
    m = 2
    backend = "isal"               # "isal" or "zfec"; a cluster uses one
    max_block_bytes = 16777216
    [client]
    read_fanout = 11               # nodes asked per read (k <= fanout <= k+m)
    write_quorum = 11              # shards a put waits for before it returns
    min_write_shards = 0           # a put fails below this many (0 = k): degraded writes
    hedge_delay_s = 0.1            # a node this late is routed around (reads and puts)
    timeout_s = 5.0
    [ttl]
    time_scale = 1.0               # virtual seconds per real second
    origin_unix_s = 1764400000.0   # real time the virtual clock starts from
    expiry_window_s = 3600.0       # segments group shards whose expiry falls in one window
    eviction_order = "lru"         # under capacity pressure: "lru" or "expiry" (ttl/policy.py)
    refresh_granularity_s = 60.0   # a hit this soon after the last access restarts no TTL
    [ttl.classes]
    chat = "7d"
    agent = "3d"
    [tls]                          # kvstore/tls.py; "auto" = on when a node is off loopback
    mode = "auto"
    ca_file = "/etc/kvstore/tls/ca.pem"
    [encryption]                   # optional, client-side per tenant (client/sealer.py)
    tenants = ["acme"]
    keyring_file = "/etc/kvstore/keyring.json"
    master_key_file = "/etc/kvstore/master.key"
    [integrity]                    # optional: keyed block versions (client/integrity.py)
    key_file = "/etc/kvstore/integrity.json"
    [node_defaults]                # any NodeConfig field (kvstore/node_config.py); a
                                   # [[nodes]] entry may override it
    fsync = true
    [[nodes]]
    id = "n00"
    address = "127.0.0.1:50100"
    metrics_port = 50200
    failure_domain = "host-a"
    data_dir = "/var/lib/kvstore/n00"
    [[groups]]
    nodes = ["n00", "n01", ...]    # k+m node ids; shard i lives on nodes[i]

Sizes and durations may be written with units: ``max_bytes = "30GiB"``,
``expiry_window_s = "1h"`` (any field named ``*_bytes``, ``*_bytes_per_s`` or ``*_s``).
Every dataclass validates itself in ``__post_init__`` and raises ``ValueError`` with advice.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from erasure.config import CodecConfig
from kvstore.node_config import NodeConfig
from ttl.policy import (
    DEFAULT_CLASS_TO_TTL_S,
    DEFAULT_EVICTION_ORDER,
    EvictionOrder,
    TrafficClasses,
)
from ttl.units import parse_duration_s, parse_size_bytes

KEY_BYTES = 16  # block keys are xxh3-128 digests


# How a client's reads travel (KVClient.connect's transport; docs/data-paths.md).
READ_TRANSPORTS = ("grpc", "auto", "ucx", "local", "stream")


@dataclass(frozen=True)
class ClientConfig:
    """How clients read and write.

    A put returns once ``write_quorum`` shards are stored, or ``hedge_delay_s`` after
    ``min_write_shards`` (0 = k) were: a down or hung node costs a put at most the hedge delay,
    and its shards are queued for repair. A read asks ``read_fanout`` nodes and, if they have
    not given k shards after ``hedge_delay_s``, the rest too.
    """

    read_fanout: int = 11
    write_quorum: int = 11
    min_write_shards: int = 0
    hedge_delay_s: float = 0.1
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"client timeout_s must be > 0, got {self.timeout_s}")
        if not 0 <= self.hedge_delay_s < self.timeout_s:
            raise ValueError(
                f"client hedge_delay_s must be >= 0 and below timeout_s ({self.timeout_s}), "
                f"got {self.hedge_delay_s}"
            )


@dataclass(frozen=True)
class TTLConfig:
    classes: TrafficClasses = field(default_factory=TrafficClasses)
    time_scale: float = 1.0
    origin_unix_s: float = 0.0
    expiry_window_s: float = 3600.0
    eviction_order: str = DEFAULT_EVICTION_ORDER.value  # "lru" or "expiry" (ttl/policy.py)
    # A hit this soon after a block's last access (or within 0.1% of its TTL, if shorter)
    # restarts nothing: kvstore/store/read_state.py. 0: every hit restarts its TTL.
    refresh_granularity_s: float = 60.0

    def __post_init__(self) -> None:
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if self.expiry_window_s <= 0:
            raise ValueError(f"expiry_window_s must be > 0, got {self.expiry_window_s}")
        if self.refresh_granularity_s < 0:
            raise ValueError(
                f"refresh_granularity_s must be >= 0, got {self.refresh_granularity_s}"
            )
        if self.eviction_order not in {order.value for order in EvictionOrder}:
            raise ValueError(
                f"[ttl] eviction_order {self.eviction_order!r}: choose 'lru' (least recently "
                "accessed first, the default) or 'expiry' (earliest expiry first)"
            )

    @property
    def eviction(self) -> EvictionOrder:
        """The configured eviction order as the policy object the store and simulator share."""
        return EvictionOrder(self.eviction_order)


@dataclass(frozen=True)
class MembershipConfig:
    """Membership on etcd (kvstore/membership.py). ``[membership]`` in cluster.toml.

    With ``etcd`` empty (the default) the static file is the whole map, for one-host use.
    With an endpoint, the map lives in etcd under ``prefix``: nodes register under a lease of
    ``lease_ttl_s`` (kept alive), and a node down for ``down_out_s`` of cluster time (the
    ``[ttl]`` clock, so tests can scale it) is marked out and its slots replaced.
    """

    etcd: str = ""  # "host:port" of an etcd v3 endpoint (several: comma-separated)
    prefix: str = "/kvstore"
    lease_ttl_s: float = 10.0
    down_out_s: float = 600.0
    # TLS to etcd (kvstore/membership.py): the CA that signed etcd's certificate ("" =
    # plaintext); the etcd client certificate of nodes and operators (may change the map),
    # and of clients that only follow it (reader_*; default: the former).
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    reader_cert_file: str = ""
    reader_key_file: str = ""

    def __post_init__(self) -> None:
        pairs = ((self.cert_file, self.key_file), (self.reader_cert_file, self.reader_key_file))
        if any(bool(c) != bool(k) or (c and not self.ca_file) for c, k in pairs):
            raise ValueError(
                "[membership] each cert_file goes with its key_file, and with ca_file (TLS to etcd)"
            )
        if self.lease_ttl_s < 2 or self.down_out_s <= 0:
            raise ValueError(
                f"[membership] needs lease_ttl_s >= 2 (etcd grants whole seconds) and "
                f"down_out_s > 0, got {self.lease_ttl_s} and {self.down_out_s}"
            )
        if not self.prefix.startswith("/"):
            raise ValueError(f"[membership] prefix must start with '/', got {self.prefix!r}")

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(e.strip() for e in self.etcd.split(",") if e.strip())


LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
TLS_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class TLSConfig:
    """TLS on every gRPC channel (kvstore/tls.py). ``[tls]`` in cluster.toml.

    ``mode = "auto"`` (the default) is on as soon as one node is not on a loopback address,
    so a multi-host map cannot run in plaintext by omission; ``"off"`` is allowed only for
    loopback clusters. The CA file is public: it says which certificates to trust.
    """

    mode: str = "auto"
    ca_file: str = ""  # PEM bundle that signs node (and client) certificates
    client_certs: str = "none"  # "require": mutual TLS, clients must present a CA-signed cert

    def __post_init__(self) -> None:
        if self.mode not in TLS_MODES:
            raise ValueError(f"[tls] mode must be one of {TLS_MODES}, got {self.mode!r}")
        if self.client_certs not in ("none", "require"):
            raise ValueError(
                f"[tls] client_certs must be 'none' or 'require', got {self.client_certs!r}"
            )

    def enabled_for(self, nodes: tuple[NodeConfig, ...]) -> bool:
        if self.mode == "auto":
            return any(n.host not in LOOPBACK_HOSTS for n in nodes)
        return self.mode == "on"


@dataclass(frozen=True)
class EncryptionConfig:
    """Client-side encryption at rest per tenant (client/sealer.py). ``[encryption]``.

    Paths name files on the trusted client hosts (the serving tier), never secrets
    themselves: the master key file (mode 0600) wraps each tenant's data key, and the keyring
    holds the wrapped keys. ``kms = "module:factory"`` replaces the master key file by an
    external KMS (a factory returning a :class:`client.keyring.KeyWrapper`).
    """

    tenants: tuple[str, ...] = ()  # tenants whose blocks are sealed; "*" = every tenant
    keyring_file: str = ""
    master_key_file: str = ""
    kms: str = ""

    def __post_init__(self) -> None:
        if self.tenants and not self.keyring_file:
            raise ValueError("[encryption] tenants are set but keyring_file is not")
        if self.tenants and not (self.master_key_file or self.kms):
            raise ValueError("[encryption] needs master_key_file or kms to wrap data keys")

    def covers(self, tenant: str) -> bool:
        return tenant in self.tenants or "*" in self.tenants


@dataclass(frozen=True)
class IntegrityConfig:
    """End-to-end block integrity (client/integrity.py). ``[integrity]``.

    ``key_file`` names a file on the client hosts (never the nodes') with each tenant's key;
    set, every tenant that is not sealed writes and requires keyed block versions.
    """

    key_file: str = ""


@dataclass(frozen=True)
class ClusterConfig:
    epoch: int
    nodes: tuple[NodeConfig, ...]
    groups: tuple[tuple[str, ...], ...]
    codec: CodecConfig = field(default_factory=CodecConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    ttl: TTLConfig = field(default_factory=TTLConfig)
    tls: TLSConfig = field(default_factory=TLSConfig)
    encryption: EncryptionConfig = field(default_factory=EncryptionConfig)
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    integrity: IntegrityConfig = field(default_factory=IntegrityConfig)
    # The groups before the map change in progress (same length as ``groups``), () when none:
    # reads consult them too until the move is complete; writes go to ``groups`` only.
    moving_from: tuple[tuple[str, ...], ...] = ()
    # The groups' rendezvous weights as the map records them (``weight`` of each [[groups]]
    # entry), () when none: placement then derives them from the nodes' byte limits
    # (kvstore/placement_weights.py). A map change keeps the weights its map placed by.
    group_weights: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        ids = [n.id for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate node ids in cluster map: {sorted(ids)}")
        known = set(ids)
        for group in self.groups:
            if len(group) != self.codec.num_shards:
                raise ValueError(
                    f"group {list(group)} has {len(group)} nodes; every group "
                    f"needs k+m = {self.codec.num_shards}"
                )
            if len(set(group)) != len(group) or not set(group) <= known:
                raise ValueError(f"group {list(group)} repeats a node or names an unknown one")
        if not self.groups:
            raise ValueError("the cluster map has no placement groups")
        if self.moving_from and len(self.moving_from) != len(self.groups):
            raise ValueError(
                f"moving_from has {len(self.moving_from)} groups, groups {len(self.groups)}: "
                "a move keeps the number of groups"
            )
        for group in self.moving_from:
            if len(group) != self.codec.num_shards or not set(group) <= known:
                raise ValueError(f"moving_from group {list(group)} is malformed")
        if self.group_weights and (
            len(self.group_weights) != len(self.groups)
            or not all(type(w) is int and w >= 1 for w in self.group_weights)
        ):
            raise ValueError(
                f"group weights {list(self.group_weights)} must be one integer >= 1 per group "
                f"({len(self.groups)} groups), or none"
            )
        k, n = self.codec.k, self.codec.num_shards
        if not k <= self.client.read_fanout <= n:
            raise ValueError(f"read_fanout {self.client.read_fanout} must be in [k={k}, k+m={n}]")
        if not k <= self.client.write_quorum <= n:
            raise ValueError(f"write_quorum {self.client.write_quorum} must be in [{k}, {n}]")
        if self.client.min_write_shards and not k <= self.client.min_write_shards <= (
            self.client.write_quorum
        ):
            raise ValueError(
                f"min_write_shards {self.client.min_write_shards} must be 0 (= k) or in "
                f"[k={k}, write_quorum={self.client.write_quorum}]: fewer than k shards are "
                "never readable"
            )
        self._check_tls()

    @property
    def min_write_shards(self) -> int:
        """Shards below which a put fails (``[client] min_write_shards``, 0 = k)."""
        return self.client.min_write_shards or self.codec.k

    def _check_tls(self) -> None:
        remote = [n.id for n in self.nodes if n.host not in LOOPBACK_HOSTS]
        if self.tls.mode == "off" and remote:
            raise ValueError(
                f"[tls] mode = 'off' but nodes {remote[:3]} are not on loopback: tokens and "
                "blocks would cross the network in plaintext; make certificates with "
                "`kvstore certs init|issue` and set [tls] ca_file and each node's tls_cert_file"
            )
        if not self.tls_enabled:
            return
        if not self.tls.ca_file:
            raise ValueError("TLS is on ([tls] mode, or nodes off loopback) but ca_file is unset")
        missing = [n.id for n in self.nodes if not (n.tls_cert_file and n.tls_key_file)]
        if missing:
            raise ValueError(
                f"TLS is on but nodes {missing[:3]} have no tls_cert_file/tls_key_file; "
                "issue them with `kvstore certs issue`"
            )

    @property
    def tls_enabled(self) -> bool:
        return self.tls.enabled_for(self.nodes)

    def node(self, node_id: str) -> NodeConfig:
        for node in self.nodes:
            if node.id == node_id:
                return node
        raise ValueError(
            f"node {node_id!r} is not in the cluster map "
            f"(known: {', '.join(n.id for n in self.nodes)})"
        )


_REMOVED_NODE_FIELDS = {
    "auth_token": "the shared cluster token is gone: nodes read principals from "
    "credentials_file (kvstore cluster add-tenant) and clients pass their own token",
}
_NODE_DEFAULTS = {f.name for f in dataclasses.fields(NodeConfig)} - {
    "id",
    "address",
    "metrics_port",
    "failure_domain",
    "data_dir",
    "state",
}


def with_units(raw: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` with sizes and durations written as strings parsed (ttl/units.py): a field
    named ``*_bytes`` or ``*_bytes_per_s`` takes "64MiB", one named ``*_s`` takes "1h"."""
    parsed = dict(raw)
    for name, value in raw.items():
        if not isinstance(value, str):
            continue
        if name.endswith(("_bytes", "_bytes_per_s")):
            parsed[name] = parse_size_bytes(value)
        elif name.endswith("_s"):
            parsed[name] = parse_duration_s(value)
    return parsed


_SECTIONS = (
    "epoch",
    "codec",
    "client",
    "ttl",
    "tls",
    "encryption",
    "membership",
    "integrity",
    "moving_from",
    "node_defaults",
    "nodes",
    "groups",
)
_NODE_REQUIRED = ("id", "address", "metrics_port", "failure_domain", "data_dir")
_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def checked_fields(
    section: str, raw: object, cls: type, *, allowed: Collection[str] | None = None
) -> dict[str, Any]:
    """The keys of one ``cluster.toml`` table checked against ``cls``'s fields: a table, only
    known keys (``allowed``, default every field), each value of its field's type (sizes and
    durations may carry units). ValueError names the section, the key and what was expected."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{section} must be a table of key = value lines, got {raw!r}")
    known = set(allowed if allowed is not None else (f.name for f in dataclasses.fields(cls)))
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(
            f"unknown key {', '.join(map(repr, unknown))} in {section}; known keys: "
            f"{', '.join(sorted(known))}"
        )
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in raw.items():
        try:
            values[key] = with_units({key: value})[key]
        except ValueError as exc:
            raise ValueError(f"{section} {key}: {exc}") from None
    return {key: _typed(section, key, value, hints.get(key)) for key, value in values.items()}


def _typed(section: str, key: str, value: Any, hint: object) -> Any:
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    is_int = isinstance(value, int) and not isinstance(value, bool)
    ok = {bool: isinstance(value, bool), int: is_int, float: isinstance(value, float)}
    ok[str] = isinstance(value, str)
    if hint in ok and not ok[hint]:  # type: ignore[index]
        raise ValueError(
            f"{section} {key} must be {_TYPE_WORDS[hint]}, got {value!r} "  # type: ignore[index]
            f"({type(value).__name__})"
        )
    return value


def _ttl_from_toml(raw: object) -> TTLConfig:
    section = "[ttl]"
    fields = checked_fields(section, raw, TTLConfig)
    raw_classes = fields.pop("classes", DEFAULT_CLASS_TO_TTL_S)
    if not isinstance(raw_classes, Mapping):
        raise ValueError(f"[ttl.classes] must be a table of class = duration, got {raw_classes!r}")
    classes = TrafficClasses({name: parse_duration_s(v) for name, v in raw_classes.items()})
    return TTLConfig(classes=classes, **fields)


def _node_from_toml(position: int, raw: object, defaults: Mapping[str, Any]) -> NodeConfig:
    name = raw.get("id", position) if isinstance(raw, Mapping) else position
    section = f"[[nodes]] entry {position} ({name})"
    fields = {**defaults, **checked_fields(section, raw, NodeConfig)}
    missing = [key for key in _NODE_REQUIRED if key not in fields]
    if missing:
        raise ValueError(f"{section} lacks {', '.join(missing)}; every node needs them")
    return NodeConfig(**fields)


def _group_from_toml(position: int, raw: object, table: str = "[[groups]]") -> tuple[str, ...]:
    section = f"{table} entry {position}"
    keys = {"nodes", "weight"} if table == "[[groups]]" else {"nodes"}
    if not isinstance(raw, Mapping) or "nodes" not in raw or not set(raw) <= keys:
        raise ValueError(
            f"{section} must hold nodes = [node ids]"
            + (" and may hold weight = N" if "weight" in keys else "")
            + f", got {raw!r}"
        )
    members = raw["nodes"]
    if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
        raise ValueError(f"{section} nodes must be a list of node ids, got {members!r}")
    return tuple(members)


def _weights_from_toml(groups: list[Any]) -> tuple[int, ...]:
    """The ``weight`` of every [[groups]] entry, or () when none has one."""
    weights = [g.get("weight") for g in groups if isinstance(g, Mapping)]
    if all(w is None for w in weights):
        return ()
    if any(w is None for w in weights):
        raise ValueError("[[groups]]: give every entry a weight, or none")
    return tuple(weights)


def _check_removed(fields: Mapping[str, Any]) -> None:
    for name, advice in _REMOVED_NODE_FIELDS.items():
        if name in fields:
            raise ValueError(f"{name} is no longer a node field: {advice}")


def cluster_from_dict(raw: Mapping[str, Any]) -> ClusterConfig:
    """The cluster map from parsed TOML, every section checked (see :func:`checked_fields`)."""
    unknown = sorted(set(raw) - set(_SECTIONS))
    if unknown:
        raise ValueError(
            f"unknown section or key {', '.join(map(repr, unknown))} at the top of the cluster "
            f"map; known: {', '.join(_SECTIONS)}"
        )
    epoch = raw.get("epoch", 1)
    if not isinstance(epoch, int) or isinstance(epoch, bool):
        raise ValueError(f"epoch must be an integer, got {epoch!r}")
    nodes, groups = raw.get("nodes", []), raw.get("groups", [])
    if not isinstance(nodes, list) or not isinstance(groups, list):
        raise ValueError("nodes and groups must be arrays of tables ([[nodes]], [[groups]])")
    for fields in (raw.get("node_defaults", {}), *nodes):
        if isinstance(fields, Mapping):
            _check_removed(fields)
    defaults = checked_fields(
        "[node_defaults]", raw.get("node_defaults", {}), NodeConfig, allowed=_NODE_DEFAULTS
    )
    encryption = checked_fields("[encryption]", raw.get("encryption", {}), EncryptionConfig)
    if "tenants" in encryption:
        encryption["tenants"] = tuple(encryption["tenants"])
    return ClusterConfig(
        epoch=epoch,
        nodes=tuple(_node_from_toml(i, n, defaults) for i, n in enumerate(nodes)),
        groups=tuple(_group_from_toml(i, g) for i, g in enumerate(groups)),
        group_weights=_weights_from_toml(groups),
        codec=CodecConfig(**checked_fields("[codec]", raw.get("codec", {}), CodecConfig)),
        client=ClientConfig(**checked_fields("[client]", raw.get("client", {}), ClientConfig)),
        ttl=_ttl_from_toml(raw.get("ttl", {})),
        tls=TLSConfig(**checked_fields("[tls]", raw.get("tls", {}), TLSConfig)),
        encryption=EncryptionConfig(**encryption),
        membership=MembershipConfig(
            **checked_fields("[membership]", raw.get("membership", {}), MembershipConfig)
        ),
        integrity=IntegrityConfig(
            **checked_fields("[integrity]", raw.get("integrity", {}), IntegrityConfig)
        ),
        moving_from=tuple(
            _group_from_toml(i, g, "[[moving_from]]")
            for i, g in enumerate(raw.get("moving_from", []))
        ),
    )


def load_cluster(path: str | Path) -> ClusterConfig:
    """Read and validate ``cluster.toml``; errors name the file."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
        return cluster_from_dict(raw)
    except FileNotFoundError:
        raise ValueError(
            f"no cluster config at {path}; start a cluster with "
            f"`kvstore cluster up --dir {path.parent}`"
        ) from None
    except (tomllib.TOMLDecodeError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from exc


def _ttl_s_to_toml(ttl_s: float) -> str | float:
    return "inf" if math.isinf(ttl_s) else ttl_s


def cluster_to_dict(cfg: ClusterConfig) -> dict[str, Any]:
    ttl = dataclasses.asdict(cfg.ttl)
    ttl["classes"] = {k: _ttl_s_to_toml(v) for k, v in cfg.ttl.classes.class_to_ttl_s.items()}
    raw: dict[str, Any] = {
        "epoch": cfg.epoch,
        "codec": dataclasses.asdict(cfg.codec),
        "client": dataclasses.asdict(cfg.client),
        "ttl": ttl,
        "tls": dataclasses.asdict(cfg.tls),
    }
    if cfg.encryption.tenants:
        encryption = dataclasses.asdict(cfg.encryption)
        raw["encryption"] = {**encryption, "tenants": list(cfg.encryption.tenants)}
    if cfg.membership != MembershipConfig():
        raw["membership"] = dataclasses.asdict(cfg.membership)
    if cfg.integrity != IntegrityConfig():
        raw["integrity"] = dataclasses.asdict(cfg.integrity)
    raw["nodes"] = [dataclasses.asdict(n) for n in cfg.nodes]
    raw["groups"] = [{"nodes": list(g)} for g in cfg.groups]
    for entry, weight in zip(raw["groups"], cfg.group_weights, strict=False):
        entry["weight"] = weight
    if cfg.moving_from:
        raw["moving_from"] = [{"nodes": list(g)} for g in cfg.moving_from]
    return raw


def cluster_to_toml(cfg: ClusterConfig) -> str:
    """The cluster map as TOML text: the one serialisation, for files and for etcd."""
    return tomli_w.dumps(cluster_to_dict(cfg))


def cluster_from_toml(text: str, source: str = "cluster map") -> ClusterConfig:
    """The cluster map from TOML text; errors name ``source``."""
    try:
        return cluster_from_dict(tomllib.loads(text))
    except (tomllib.TOMLDecodeError, TypeError, ValueError) as exc:
        raise ValueError(f"{source}: {exc}") from exc


def save_cluster(cfg: ClusterConfig, path: str | Path) -> None:
    """Write ``cluster.toml`` atomically (temp file, then rename)."""
    path = Path(path)
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(cluster_to_toml(cfg))
    tmp.replace(path)
