"""``kvstore certs init|issue``: a development CA and certificates, made with ``cryptography``.

::

    kvstore certs init  --dir DIR [--days 3650]            DIR/ca.pem, DIR/ca.key (0600)
    kvstore certs issue --dir DIR ID --node --host H [--host H2 ...] [--days 825]
                                      a node's:  DIR/ID.pem, DIR/ID.key (0600)
    kvstore certs issue --dir DIR NAME --server --host H [--host H2 ...] [--days 825]
                                      another server's (a serving tier's workers)
    kvstore certs issue --dir DIR NAME [--days 825]
                                      a client's: DIR/NAME.pem, DIR/NAME.key (0600)

Two kinds, told apart by their extended key usage (kvstore/tls.py says how they are checked):

- a **node certificate** (``--node``) names the node id as the DNS SAN ``ID.node.kvstore``
  beside the hosts it serves on, and may serve (serverAuth) and dial its peers (clientAuth).
  Clients and peers accept a node only with the certificate of the id the map puts at its
  address; its certificate is also what a node credential must come with under mutual TLS.
- a **client certificate** may only authenticate a client (clientAuth): a server presenting
  it fails every handshake. Its common name (NAME) is the identity a principal of the
  credentials file may claim (``cert_identity``, kvstore/auth.py).

Rotating a certificate is issuing it again: nodes re-read their files at the next handshake
(kvstore/tls.py), clients when they connect.
Keys are ECDSA P-256: fast to make (a 12-node local cluster issues twelve in well under a
second) and accepted by gRPC's TLS. For production, use your own PKI; the nodes only read
PEM files.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import sys
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvstore.auth import write_private
from kvstore.tls import node_server_name

CA_CERT = "ca.pem"
CA_KEY = "ca.key"


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvstore development CA"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def make_ca(days: float = 3650) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) of a new self-signed CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("kvstore dev CA"))
        .issuer_name(_name("kvstore dev CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def issue(
    ca_cert_pem: bytes,
    ca_key_pem: bytes,
    name: str,
    hosts: Sequence[str] = (),
    *,
    node: bool = False,
    server: bool = False,
    days: float = 825,
    not_before: datetime.datetime | None = None,
) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) for ``name``: with ``node``, node ``name``'s certificate,
    valid for ``hosts`` (DNS names or IPs) and its id's name; with ``server``, another
    server's (etcd's) for ``hosts``; else a client certificate.

    ``not_before`` moves the validity window (tests make expired certificates with it).
    """
    if hosts and not (node or server):
        raise ValueError(
            f"--host given for {name!r} without --node: only node certificates serve; a client "
            "certificate names no host"
        )
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if node or server:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    if node:
        hosts = [node_server_name(name), *hosts]
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey), "the CA key must be ECDSA"
    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before or datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    if hosts:
        builder = builder.add_extension(_san(hosts), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def init_ca(directory: Path, days: float = 3650) -> Path:
    """Write ``DIR/ca.pem`` and ``DIR/ca.key`` (0600) unless they exist; return the cert path."""
    directory.mkdir(parents=True, exist_ok=True)
    cert_path = directory / CA_CERT
    if not cert_path.exists():
        cert_pem, key_pem = make_ca(days)
        write_private(directory / CA_KEY, key_pem.decode())
        cert_path.write_bytes(cert_pem)
    return cert_path


def issue_files(
    directory: Path,
    name: str,
    hosts: Sequence[str] = (),
    *,
    node: bool = False,
    server: bool = False,
    days: float = 825,
) -> tuple[Path, Path]:
    """Issue ``name``'s certificate (a node's with ``node``, see :func:`issue`) with the CA in
    ``directory``, replacing one there; (cert path, key path)."""
    try:
        ca_cert_pem = (directory / CA_CERT).read_bytes()
        ca_key_pem = (directory / CA_KEY).read_bytes()
    except FileNotFoundError:
        raise ValueError(
            f"no CA in {directory}: run `kvstore certs init --dir {directory}` first"
        ) from None
    cert_pem, key_pem = issue(
        ca_cert_pem, ca_key_pem, name, hosts, node=node, server=server, days=days
    )
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    write_private(key_path, key_pem.decode())
    cert_path.write_bytes(cert_pem)
    return cert_path, key_path


def configure_init(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", required=True, type=Path, help="where ca.pem and ca.key go")
    parser.add_argument("--days", type=float, default=3650, help="validity of the CA")


def run_init(args: argparse.Namespace) -> int:
    path = init_ca(args.dir, args.days)
    print(f"CA certificate: {path} (key: {args.dir / CA_KEY}, mode 0600)")
    return 0


def configure_issue(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", required=True, type=Path, help="the CA's directory (certs init)")
    parser.add_argument("name", help="common name: a node id, or a principal's cert_identity")
    parser.add_argument(
        "--node",
        action="store_true",
        help="a node's certificate (NAME is its node id): it may serve; else a client's",
    )
    parser.add_argument(
        "--server",
        action="store_true",
        help="a server's certificate that names no node (a serving tier's workers, "
        "kvstore serve --tls-cert-file): it may serve on --host and dial",
    )
    parser.add_argument(
        "--host",
        action="append",
        default=[],
        help="with --node or --server: a DNS name or IP address it serves on (repeat the flag)",
    )
    parser.add_argument("--days", type=float, default=825, help="validity of the certificate")


def run_issue(args: argparse.Namespace) -> int:
    try:
        cert_path, key_path = issue_files(
            args.dir, args.name, args.host, node=args.node, server=args.server, days=args.days
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"certificate: {cert_path} (key: {key_path}, mode 0600)")
    return 0
