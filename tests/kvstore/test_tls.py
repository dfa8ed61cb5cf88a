"""TLS on a real node: certificates verified, wrong or expired ones refused, mutual TLS
identities, and a certificate replaced without a restart."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from client import KVClient
from kvstore.auth import Role, add_principal
from kvstore.auth import write_private as write_key
from kvstore.certs import init_ca, issue, issue_files
from kvstore.config import TLSConfig
from kvstore.errors import InvalidArgument, PermissionDenied, Unavailable
from tests.kvstore.node_harness import write_config

pytestmark = pytest.mark.timeout(120)
KEY = b"t" * 16


def _node_cert(tls_dir: Path) -> dict[str, str]:
    cert, key = issue_files(tls_dir, "n0", ["127.0.0.1", "localhost"], node=True)
    return {"tls_cert_file": str(cert), "tls_key_file": str(key)}


def _tls_node(tmp_path: Path, start_node, client_certs: str = "none", **fields) -> Path:
    tls_dir = tmp_path / "tls"
    ca = init_ca(tls_dir)
    tls = TLSConfig("on", str(ca), client_certs)
    config = write_config(tmp_path, tls=tls, **_node_cert(tls_dir), **fields)
    start_node(config)
    return config


def _other_ca_config(tmp_path: Path, config: Path) -> Path:
    """The same cluster.toml trusting an unrelated CA."""
    other = init_ca(tmp_path / "other-ca")
    text = config.read_text().replace(str(tmp_path / "tls" / "ca.pem"), str(other))
    path = tmp_path / "other.toml"
    path.write_text(text)
    return path


async def _roundtrip(config: Path, **kwargs) -> bytes | None:
    async with KVClient.connect(config, tenant="acme", **kwargs) as kv:
        await kv.put(KEY, b"over tls", timeout_s=3)
        return await kv.get(KEY, timeout_s=3)


async def test_tls_works_and_untrusted_certificates_are_refused(tmp_path: Path, start_node):
    config = _tls_node(tmp_path, start_node)
    assert await _roundtrip(config) == b"over tls"
    with pytest.raises(Unavailable):  # the client does not trust the node's certificate
        await _roundtrip(_other_ca_config(tmp_path, config))


async def test_expired_node_certificate_is_refused(tmp_path: Path, start_node):
    tls_dir = tmp_path / "tls"
    ca = init_ca(tls_dir)
    past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=10)
    cert_pem, key_pem = issue(
        (tls_dir / "ca.pem").read_bytes(),
        (tls_dir / "ca.key").read_bytes(),
        "n0",
        ["127.0.0.1"],
        node=True,
        days=1,
        not_before=past,
    )
    (tls_dir / "n0.pem").write_bytes(cert_pem)
    write_key(tls_dir / "n0.key", key_pem.decode())
    config = write_config(
        tmp_path,
        tls=TLSConfig("on", str(ca)),
        tls_cert_file=str(tls_dir / "n0.pem"),
        tls_key_file=str(tls_dir / "n0.key"),
    )
    start_node(config)
    with pytest.raises(Unavailable):
        await _roundtrip(config)


async def test_mutual_tls_needs_a_certificate_of_the_ca(tmp_path: Path, start_node):
    credentials = tmp_path / "credentials.toml"
    add_principal(credentials, "acme", Role.TENANT, cert_identity="acme-prefill")
    config = _tls_node(
        tmp_path, start_node, client_certs="require", credentials_file=str(credentials)
    )
    with pytest.raises(InvalidArgument, match="client certificates"):
        await _roundtrip(config)
    good_cert, good_key = issue_files(tmp_path / "tls", "acme-prefill")
    assert (
        await _roundtrip(config, tls_cert_file=str(good_cert), tls_key_file=str(good_key))
        == b"over tls"
    ), "the certificate's common name did not authenticate tenant acme"
    stranger_cert, stranger_key = issue_files(tmp_path / "tls", "stranger")
    with pytest.raises(PermissionDenied):  # a valid certificate no principal claims
        await _roundtrip(config, tls_cert_file=str(stranger_cert), tls_key_file=str(stranger_key))
    init_ca(tmp_path / "rogue")
    rogue_cert, rogue_key = issue_files(tmp_path / "rogue", "acme-prefill")
    with pytest.raises(Unavailable):  # same name, signed by another CA: handshake fails
        await _roundtrip(config, tls_cert_file=str(rogue_cert), tls_key_file=str(rogue_key))


async def test_certificate_reload_without_restart(tmp_path: Path, start_node):
    config = _tls_node(tmp_path, start_node)
    assert await _roundtrip(config) == b"over tls"
    # Replace the node's certificate with one of a new CA; new connections get it.
    new_dir = tmp_path / "new-ca"
    new_ca = init_ca(new_dir)
    cert, key = issue_files(new_dir, "n0", ["127.0.0.1"], node=True)
    (tmp_path / "tls" / "n0.key").write_bytes(key.read_bytes())
    (tmp_path / "tls" / "n0.pem").write_bytes(cert.read_bytes())
    trusting_new = tmp_path / "new.toml"
    trusting_new.write_text(
        config.read_text().replace(str(tmp_path / "tls" / "ca.pem"), str(new_ca))
    )
    assert await _roundtrip(trusting_new) == b"over tls", "the node still serves the old cert"
    with pytest.raises(Unavailable):
        await _roundtrip(config)
