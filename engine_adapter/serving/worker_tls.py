"""TLS on the router's channels to its workers, whenever the store's cluster runs TLS.

::

    router --mutual TLS, the cluster's CA--> prefill / decode worker (gRPC, 127.0.0.1)
           presents the serving certificate  serves with the same certificate and takes
                                             calls only from a client presenting it (its
                                             common name), so no other holder of a
                                             certificate of the cluster's CA (a tenant's
                                             client certificate, a node) can drive a worker

The serving certificate is ``kvstore serve --tls-cert-file/--tls-key-file`` (issued by the
cluster's CA for the workers' host as a server certificate that names no node: ``kvstore
certs issue --dir CA_DIR serving --server --host 127.0.0.1``), or, when the cluster's CA key
sits beside its CA file (a development cluster from ``kvstore cluster up --tls``), one
``kvstore serve`` issues itself into its run directory. Without TLS on the cluster the
channels are plaintext on 127.0.0.1, as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.x509.oid import NameOID

from kvstore.auth import write_private
from kvstore.certs import CA_KEY, issue
from kvstore.config import load_cluster
from kvstore.errors import InvalidArgument, PermissionDenied
from kvstore.tls import peer_certificate

log = logging.getLogger(__name__)

SERVING_CERT_NAME = "kvstore-serve"
WORKER_HOSTS = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class WorkerTLS:
    """The CA and the serving certificate the router and its workers share."""

    ca_file: str
    cert_file: str
    key_file: str

    def _read(self) -> tuple[bytes, bytes, bytes]:
        try:
            return tuple(
                Path(p).read_bytes() for p in (self.ca_file, self.cert_file, self.key_file)
            )  # type: ignore[return-value]
        except OSError as exc:
            raise InvalidArgument(f"cannot read the serving TLS files: {exc}") from None

    def server_credentials(self) -> grpc.ServerCredentials:
        """A worker's: its certificate, and client certificates of the CA required."""
        ca, cert, key = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=True)  # fmt: skip

    def face_credentials(self) -> grpc.ServerCredentials:
        """The router's gRPC face (``--grpc-port``): its certificate, any client (server TLS
        only; ``ServingClient`` callers verify it with the CA)."""
        _, cert, key = self._read()
        return grpc.ssl_server_credentials([(key, cert)])

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """The router's: the CA to verify workers, the certificate to present to them."""
        ca, cert, key = self._read()
        return grpc.ssl_channel_credentials(ca, private_key=key, certificate_chain=cert)

    def identity(self) -> str:
        """The serving certificate's common name: the one client a worker takes calls from."""
        cert = x509.load_pem_x509_certificate(self._read()[1])
        names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        return str(names[0].value) if names else ""

    def argv(self) -> list[str]:
        """The worker command line that hands these files to a worker."""
        return ["--tls-ca-file", self.ca_file, "--tls-cert-file", self.cert_file,
                "--tls-key-file", self.key_file]  # fmt: skip


def check_peer(context: Any, identity: str | None) -> None:
    """PermissionDenied unless the call's client certificate names ``identity`` and is no
    node's (None: no TLS, every caller is on 127.0.0.1)."""
    if identity is None:
        return
    peer = peer_certificate(context)
    if peer is None or peer.common_name != identity or peer.node_id is not None:
        raise PermissionDenied(
            f"worker calls are taken only from the serving certificate {identity!r}, "
            f"not from {peer.common_name if peer else None!r}"
        )


def worker_tls_for(
    cluster_toml: Path, cert_file: Path | None, key_file: Path | None, run_dir: Path
) -> WorkerTLS | None:
    """The router-worker TLS of a serving tier on ``cluster_toml``: None when the cluster
    runs without TLS; the given certificate; or one issued by a development CA (module doc)."""
    cluster = load_cluster(cluster_toml)
    if not cluster.tls_enabled:
        if cert_file or key_file:
            raise InvalidArgument(
                "--tls-cert-file/--tls-key-file given, but the cluster runs without TLS: "
                "router and workers then talk plaintext on 127.0.0.1; drop the flags"
            )
        return None
    ca_file = cluster.tls.ca_file
    if cert_file and key_file:
        return WorkerTLS(ca_file, str(cert_file), str(key_file))
    if cert_file or key_file:
        raise InvalidArgument("give both --tls-cert-file and --tls-key-file")
    ca_key = Path(ca_file).with_name(CA_KEY)
    if not ca_key.is_file():
        raise InvalidArgument(
            "the cluster runs TLS, so router and workers do too: give --tls-cert-file and "
            "--tls-key-file, a certificate of the cluster's CA for 127.0.0.1 (kvstore certs "
            "issue --dir CA_DIR serving --server --host 127.0.0.1)"
        )
    return _issue_for_run(ca_file, ca_key, run_dir / "tls")


def _issue_for_run(ca_file: str, ca_key: Path, directory: Path) -> WorkerTLS:
    """A serving certificate from the development CA, written into ``directory``."""
    cert_pem, key_pem = issue(
        Path(ca_file).read_bytes(),
        ca_key.read_bytes(),
        SERVING_CERT_NAME,
        WORKER_HOSTS,
        server=True,  # workers serve with it, the router dials with it
    )
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / "serving.pem", directory / "serving.key"
    write_private(key_path, key_pem.decode())
    cert_path.write_bytes(cert_pem)
    log.info("issued the serving certificate %s from the cluster's CA", cert_path)
    return WorkerTLS(ca_file, str(cert_path), str(key_path))
