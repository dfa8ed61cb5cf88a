"""The secrets of a local cluster's directory: auth (a credentials file, admin and node
tokens), TLS (a development CA and a certificate per node), encryption at rest (a master key
and a keyring) and integrity keys, and how a local tool finds the admin's token and client
certificate there (local_cluster.py's module doc has the directory's layout)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from client.integrity import ensure_key
from client.keyring import new_master_key
from kvstore.auth import Role, add_principal, read_token_file, write_private
from kvstore.certs import init_ca, issue_files
from kvstore.config import (
    ClusterConfig,
    EncryptionConfig,
    IntegrityConfig,
    TLSConfig,
)

CREDENTIALS_FILE = "credentials.toml"
ADMIN_TOKEN_FILE = "admin.token"
NODE_TOKEN_FILE = "node.token"
TLS_DIR = "tls"
MASTER_KEY_FILE = "master.key"
INTEGRITY_KEY_FILE = "integrity.json"
KEYRING_FILE = "keyring.json"


def secure(
    root: Path,
    config: ClusterConfig,
    *,
    auth: bool,
    tls: bool,
    mtls: bool,
    encrypt: Sequence[str] = (),
    integrity: bool = False,
) -> ClusterConfig:
    """``config`` with auth (credentials file, admin and node tokens), TLS (a dev CA, a
    certificate per node; ``mtls``: client certificates required), encryption at rest for
    the ``encrypt`` tenants (a master key file and a keyring) and end-to-end ``integrity``
    (a key file for the tenants' integrity keys) set up under ``root``."""
    nodes = config.nodes
    encryption = config.encryption
    if integrity:
        key_file = root / INTEGRITY_KEY_FILE
        key_file.unlink(missing_ok=True)
        config = dataclasses.replace(config, integrity=IntegrityConfig(str(key_file.resolve())))
    if encrypt:
        master = new_master_key(root / MASTER_KEY_FILE)
        encryption = EncryptionConfig(
            tuple(encrypt), str((root / KEYRING_FILE).resolve()), str(master.resolve())
        )
    if auth:
        credentials = root / CREDENTIALS_FILE
        credentials.unlink(missing_ok=True)
        write_private(root / ADMIN_TOKEN_FILE, add_principal(credentials, "admin", Role.ADMIN))
        node_token = add_principal(credentials, "nodes", Role.NODE)
        write_private(root / NODE_TOKEN_FILE, node_token)
        nodes = tuple(
            dataclasses.replace(
                n,
                credentials_file=str(credentials.resolve()),
                peer_token_file=str((root / NODE_TOKEN_FILE).resolve()),
                metrics_auth=True,  # /metrics names tenants: only an admin or node reads it
            )
            for n in nodes
        )
    tls_config = config.tls
    if tls:
        tls_dir = root / TLS_DIR
        ca_file = init_ca(tls_dir)
        issued = {n.id: issue_files(tls_dir, n.id, [n.host], node=True) for n in nodes}
        issue_files(tls_dir, "admin")
        nodes = tuple(
            dataclasses.replace(
                n,
                tls_cert_file=str(issued[n.id][0].resolve()),
                tls_key_file=str(issued[n.id][1].resolve()),
            )
            for n in nodes
        )
        tls_config = TLSConfig("on", str(ca_file.resolve()), "require" if mtls else "none")
    return dataclasses.replace(config, nodes=nodes, tls=tls_config, encryption=encryption)


def provision_integrity(
    key_file: str, name: str, role: Role, tenants: Sequence[str] = ()
) -> list[str]:
    """With an integrity key file (``[integrity] key_file``; "" = integrity off), make the
    integrity key of each tenant principal ``name`` acts for (itself, or a service's listed
    tenants; client/integrity.py); the tenants whose key it made."""
    acts_for = [name] if role is Role.TENANT else [t for t in tenants if t != "*"]
    if not key_file or role not in (Role.TENANT, Role.SERVICE):
        return []
    return [t for t in acts_for if ensure_key(key_file, t)]


def local_admin_token(root: Path) -> str | None:
    """The admin token `cluster up --auth` wrote, or None (no auth, or not a local cluster)."""
    path = root / ADMIN_TOKEN_FILE
    return read_token_file(path) if path.exists() else None


def local_client_cert(root: Path, config: ClusterConfig) -> tuple[str | None, str | None]:
    """The admin client certificate of a local mutual-TLS cluster, else (None, None)."""
    cert, key = root / TLS_DIR / "admin.pem", root / TLS_DIR / "admin.key"
    if config.tls.client_certs == "require" and cert.exists():
        return str(cert), str(key)
    return None, None
