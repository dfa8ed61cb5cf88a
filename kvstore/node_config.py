"""One storage node's configuration (``[[nodes]]`` and ``[node_defaults]`` of cluster.toml):
where it listens, its failure domain and data, its limits, pacing and switches. The cluster's
other sections, and the loading of the file, are kvstore/config.py."""

from __future__ import annotations

from dataclasses import dataclass

MAX_PORT = 65535
MiB = 1 << 20

NODE_STATES = ("in", "draining", "out", "left")  # kvstore/map_changes.py


@dataclass(frozen=True)
class NodeConfig:
    """One storage node. Fields below ``data_dir`` may be set once under ``[node_defaults]``."""

    id: str
    address: str  # host:port the node's gRPC server binds and clients dial
    metrics_port: int  # Prometheus /metrics; 0 disables it
    failure_domain: str
    data_dir: str
    fsync: bool = True
    max_bytes: int = 0  # configured byte limit for shard data; 0 = only the disk's free space
    high_watermark: float = 0.95  # evict when used/limit passes this...
    low_watermark: float = 0.85  # ...down to this
    segment_max_bytes: int = 256 * MiB
    max_shard_bytes: int = 4 * MiB  # largest shard payload accepted (block max / k, rounded up)
    max_batch_bytes: int = 64 * MiB  # largest request a node accepts
    inject_delay_ms: float = 0.0  # test-only: a fixed delay per request (a straggler)
    # Principals (kvstore/auth.py): the node-side credentials file, mode 0600; "" = auth off.
    credentials_file: str = ""
    # /metrics needs an admin or node bearer token (/healthz never); always on with auth
    metrics_auth: bool = False
    peer_token_file: str = ""  # the token this node presents to its peers (role node)
    tls_cert_file: str = ""  # this node's certificate chain (PEM), when [tls] is on
    tls_key_file: str = ""  # its private key (PEM, mode 0600)
    tombstone_retention_s: float = 8 * 86400.0  # delete-log records kept (>= the longest TTL)
    tombstone_sync_interval_s: float = 30.0  # how often a node pulls its peers' delete logs
    scrub_bytes_per_s: int = 64 * MiB  # background re-read and verify of records; 0 = no scrub
    scrub_pass_interval_s: float = 3600.0  # a full scrub pass starts at most this often
    ucx: str = "auto"  # UCX data path for reads: "auto" = on when ucxx imports, "off"
    index_reserve_bytes: int = 0  # disk kept allocated ahead for the index; 0 = 1/32 of the limit
    repair_bytes_per_s: int = 32 * MiB  # repair reads + writes; 0 disables the repair service
    repair_scan_interval_s: float = 600.0  # a listing pass over the led groups this often
    # Membership state in the cluster map (kvstore/map_changes.py): "in" holds group slots;
    # "draining" and "out" gave theirs away in a move still in progress; "left" holds none.
    state: str = "in"
    # Local read channel for clients on this host (kvstore/node/local_server.py):
    # "auto" = on (Linux), "off"
    local_reads: str = "auto"
    # Stream read channel for clients on other hosts (kvstore/node/stream_server.py): "auto" =
    # on, "off"; its TCP port on the address's host (0 = any free port, told in Health).
    stream_reads: str = "auto"
    stream_port: int = 0

    def __post_init__(self) -> None:
        self._check_identity()
        self._check_limits()

    def _check_identity(self) -> None:
        """The node's id, state, addresses and switches."""
        if not self.id:
            raise ValueError("node id must not be empty")
        if self.state not in NODE_STATES:
            raise ValueError(
                f"node {self.id}: state {self.state!r} is not one of {NODE_STATES} "
                "(change it with `kvstore cluster join|drain|remove`, not by hand)"
            )
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= MAX_PORT:
            raise ValueError(
                f"node {self.id}: address {self.address!r} must be 'host:port' with a port in "
                f"1..{MAX_PORT}"
            )
        if not 0 <= self.metrics_port <= MAX_PORT:
            raise ValueError(
                f"node {self.id}: metrics_port {self.metrics_port} must be in 1..{MAX_PORT} "
                "(0 turns metrics off)"
            )
        if self.ucx not in ("auto", "off"):
            raise ValueError(f"node {self.id}: ucx must be 'auto' or 'off', got {self.ucx!r}")
        for name in ("local_reads", "stream_reads"):
            if getattr(self, name) not in ("auto", "off"):
                raise ValueError(
                    f"node {self.id}: {name} must be 'auto' or 'off', got {getattr(self, name)!r}"
                )
        if not 0 <= self.stream_port <= MAX_PORT:
            raise ValueError(
                f"node {self.id}: stream_port {self.stream_port} must be in 1..{MAX_PORT} "
                "(0: any free port)"
            )

    def _check_limits(self) -> None:
        """Capacity, pacing and interval settings."""
        if not 0 < self.low_watermark < self.high_watermark <= 1.0:
            raise ValueError(f"node {self.id}: need 0 < low_watermark < high_watermark <= 1")
        if self.max_bytes < 0 or self.inject_delay_ms < 0:
            raise ValueError(f"node {self.id}: max_bytes and inject_delay_ms must be >= 0")
        if self.scrub_bytes_per_s < 0 or self.scrub_pass_interval_s <= 0:
            raise ValueError(
                f"node {self.id}: need scrub_bytes_per_s >= 0 (0 disables the scrub) and "
                f"scrub_pass_interval_s > 0, got {self.scrub_bytes_per_s} and "
                f"{self.scrub_pass_interval_s}"
            )
        if self.tombstone_retention_s <= 0 or self.tombstone_sync_interval_s <= 0:
            raise ValueError(
                f"node {self.id}: tombstone_retention_s and tombstone_sync_interval_s must be > 0"
            )
        if self.index_reserve_bytes < 0:
            raise ValueError(
                f"node {self.id}: need index_reserve_bytes >= 0 (0 = automatic), got "
                f"{self.index_reserve_bytes}"
            )
        if self.repair_bytes_per_s < 0 or self.repair_scan_interval_s <= 0:
            raise ValueError(
                f"node {self.id}: need repair_bytes_per_s >= 0 (0 disables repair) and "
                f"repair_scan_interval_s > 0, got {self.repair_bytes_per_s} and "
                f"{self.repair_scan_interval_s}"
            )

    @property
    def host(self) -> str:
        return self.address.rpartition(":")[0].strip("[]")
