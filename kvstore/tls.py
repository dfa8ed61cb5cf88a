"""TLS for every gRPC channel: node servers, clients, and node-to-node channels.

When ``[tls]`` is on (cluster.toml; kvstore/config.py ``TLSConfig``), a node serves with its
``tls_cert_file``/``tls_key_file`` and every channel to a node verifies that certificate
against ``ca_file``. With ``client_certs = "require"`` (mutual TLS) the handshake fails
unless the client presents a certificate the same CA signed; the certificate's common name
is the caller's identity for the credentials file (kvstore/auth.py).

Node identity. A node's certificate names its node id as the DNS SAN ``<id>.node.kvstore``
(:func:`node_server_name`; kvstore/certs.py issues it) beside its host names, and has the
serverAuth usage; client certificates have clientAuth only, so they cannot serve. Every
channel to a node is made for the node id the cluster map puts at that address
(:func:`aio_channel` / :func:`sync_channel` with ``node_id``: gRPC's
``ssl_target_name_override``), so the handshake of every connection fails unless the server's
certificate names that node: a node holding another node's certificate, or a client's, gets
no request and no token. Nodes learn the node id of a peer from its client certificate
(:func:`peer_certificate`), which is how a node credential is tied to a node's certificate
(kvstore/auth.py :class:`NodePeers`).

Certificates are reloaded without a restart: before each handshake gRPC asks
:class:`ReloadingServerCert` for a new configuration, which re-reads the files when their
modification times changed (replace both files, new connections get the new pair; open
connections keep theirs). Clients read their files when they connect.

The stream read channel (kvstore/node/stream_server.py) uses the same files through Python's
ssl (:func:`stream_server_context`, :func:`stream_client_context`), read at each connection.

The UCX read path (kvstore/wire/ucx_frames.py) carries no TLS: with encryption at rest on
(client/sealer.py) its payloads are ciphertext, but the token in a UCX request frame
travels in the clear, so use UCX only inside a trusted network (docs/security.md says so).
"""

from __future__ import annotations

import logging
import os
import re
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvstore.config import ClusterConfig, NodeConfig

log = logging.getLogger(__name__)

CLIENT_CERT_ENV = "KVSTORE_TLS_CERT"
CLIENT_KEY_ENV = "KVSTORE_TLS_KEY"


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc}") from None


class ReloadingServerCert:
    """The node's certificate configuration, re-read when a file changes (see module doc)."""

    def __init__(self, cert_file: str, key_file: str, ca_file: str, require_client_cert: bool):
        self._paths = (cert_file, key_file, ca_file)
        self._require = require_client_cert
        self._mtimes = self._stat()
        self.initial = self._load()

    def _stat(self) -> tuple[int, ...]:
        return tuple(os.stat(p).st_mtime_ns for p in self._paths)

    def _load(self) -> Any:
        cert_file, key_file, ca_file = self._paths
        pair = (_read(key_file, "TLS key"), _read(cert_file, "TLS certificate"))
        ca = _read(ca_file, "CA file") if self._require else None
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)

    def fetch(self) -> Any:
        """gRPC's config fetcher: a new configuration if a file changed, else None."""
        try:
            mtimes = self._stat()
            if mtimes == self._mtimes:
                return None
            config = self._load()
        except (OSError, ValueError) as exc:
            log.error("keeping the current TLS certificate: %s", exc)
            return None
        self._mtimes = mtimes
        log.info("reloaded TLS certificate %s", self._paths[0])
        return config


def server_credentials(cluster: ClusterConfig, node: NodeConfig) -> grpc.ServerCredentials | None:
    """The node's server credentials, or None when TLS is off (plaintext, loopback only)."""
    if not cluster.tls_enabled:
        return None
    require = cluster.tls.client_certs == "require"
    cert = ReloadingServerCert(node.tls_cert_file, node.tls_key_file, cluster.tls.ca_file, require)
    return grpc.dynamic_ssl_server_credentials(cert.initial, cert.fetch, require)


def channel_credentials(
    cluster: ClusterConfig, cert_file: str | None = None, key_file: str | None = None
) -> grpc.ChannelCredentials | None:
    """Credentials for channels to the cluster's nodes, or None when TLS is off.

    The client certificate (mutual TLS) comes from the arguments, else from
    ``$KVSTORE_TLS_CERT`` and ``$KVSTORE_TLS_KEY``.
    """
    if not cluster.tls_enabled:
        return None
    cert_file = cert_file or os.environ.get(CLIENT_CERT_ENV)
    key_file = key_file or os.environ.get(CLIENT_KEY_ENV)
    if cluster.tls.client_certs == "require" and not (cert_file and key_file):
        raise ValueError(
            "the cluster requires client certificates (mutual TLS): pass tls_cert_file and "
            f"tls_key_file or set ${CLIENT_CERT_ENV} and ${CLIENT_KEY_ENV}"
        )
    return grpc.ssl_channel_credentials(
        root_certificates=_read(cluster.tls.ca_file, "CA file"),
        private_key=_read(key_file, "TLS key") if key_file else None,
        certificate_chain=_read(cert_file, "TLS certificate") if cert_file else None,
    )


def node_channel_credentials(
    cluster: ClusterConfig, node: NodeConfig
) -> grpc.ChannelCredentials | None:
    """Credentials for a node's own channels to its peers: its certificate is its identity."""
    return channel_credentials(cluster, node.tls_cert_file, node.tls_key_file)


def aio_channel(
    address: str,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, Any]] = (),
    *,
    node_id: str | None = None,
) -> grpc.aio.Channel:
    """A grpc.aio channel: TLS when ``credentials`` are given, else plaintext.

    ``node_id``: the server must hold that node's certificate (module doc), checked at every
    handshake; without it the certificate must only name the address's host (servers that
    are not storage nodes).
    """
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=_named(options, node_id))


def sync_channel(
    address: str,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, Any]] = (),
    *,
    node_id: str | None = None,
) -> grpc.Channel:
    """As :func:`aio_channel`, for the synchronous API (status and health tools)."""
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=_named(options, node_id))


def stream_server_context(cluster: ClusterConfig, node: NodeConfig) -> ssl.SSLContext | None:
    """The stream read channel's server context (kvstore/node/stream_server.py), read from
    the files now (a new connection after a certificate change gets the new pair), or None
    when TLS is off. The same certificate, key and client-certificate rule as gRPC's."""
    if not cluster.tls_enabled:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(node.tls_cert_file, node.tls_key_file)
    if cluster.tls.client_certs == "require":
        context.load_verify_locations(cluster.tls.ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def stream_client_context(
    cluster: ClusterConfig, cert_file: str | None = None, key_file: str | None = None
) -> ssl.SSLContext | None:
    """The client's context for stream connections, or None when TLS is off: the node's
    certificate must chain to ``ca_file`` and name the node (connect with
    ``server_hostname=node_server_name(node_id)``); the client certificate as in
    :func:`channel_credentials`."""
    if not cluster.tls_enabled:
        return None
    cert_file = cert_file or os.environ.get(CLIENT_CERT_ENV)
    key_file = key_file or os.environ.get(CLIENT_KEY_ENV)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_verify_locations(cluster.tls.ca_file)
    if cert_file and key_file:
        context.load_cert_chain(cert_file, key_file)
    return context


NODE_NAME_SUFFIX = ".node.kvstore"
_DNS_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def node_server_name(node_id: str) -> str:
    """The DNS SAN a node's certificate carries for its id: ``<id>.node.kvstore``."""
    if not _DNS_LABEL.fullmatch(node_id):
        raise ValueError(
            f"node id {node_id!r} cannot be named in a certificate: with TLS on, node ids are "
            "DNS labels (letters, digits and inner '-', at most 63), e.g. 'n00' or 'kv-00'"
        )
    return node_id + NODE_NAME_SUFFIX


def _named(options: Sequence[tuple[str, Any]], node_id: str | None) -> list[tuple[str, Any]]:
    if node_id is None:
        return list(options)
    return [*options, ("grpc.ssl_target_name_override", node_server_name(node_id))]


@dataclass(frozen=True)
class PeerCertificate:
    """What a call's verified client certificate says (mutual TLS)."""

    common_name: str
    node_id: str | None  # set when it is a node's certificate (its ``<id>.node.kvstore`` SAN)


def peer_certificate(context: Any) -> PeerCertificate | None:
    """The verified client certificate of a call, or None (no mutual TLS, or none sent)."""
    try:
        auth = context.auth_context()
    except Exception:  # not every context type has one
        return None
    names = auth.get("x509_common_name") or ()
    if not names:
        return None
    node_ids = [
        name[: -len(NODE_NAME_SUFFIX)]
        for name in (n.decode(errors="replace") for n in auth.get("peer_dns") or ())
        if name.endswith(NODE_NAME_SUFFIX)
    ]
    # One node name, or it is no node's certificate (a cert naming two nodes proves neither).
    node_id = node_ids[0] if len(node_ids) == 1 else None
    return PeerCertificate(names[0].decode(errors="replace"), node_id)
