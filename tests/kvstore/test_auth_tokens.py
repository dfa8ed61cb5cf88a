"""Token lifetimes and rotation in the credentials file (kvstore/auth.py), and where the node
credential is accepted (NodePeers): pure, no node."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvstore.auth import (
    Authenticator,
    NodePeers,
    Role,
    TokenFile,
    add_principal,
    load_credentials,
    rotate_token,
    write_private,
)
from kvstore.errors import PermissionDenied
from kvstore.tls import PeerCertificate


def _principal(path: Path, token: str, at_s: float):
    return load_credentials(path).by_token(token, at_s)


def test_a_token_with_an_expiry_is_refused_from_then_on(tmp_path: Path) -> None:
    path = tmp_path / "credentials.toml"
    token = add_principal(path, "acme", expires_in_s=3600)
    now_s = time.time()
    assert _principal(path, token, now_s).name == "acme"
    assert _principal(path, token, now_s + 3601) is None, "an expired token still authenticates"
    forever = add_principal(path, "globex")
    assert _principal(path, forever, now_s + 10 * 365 * 86400).name == "globex"


def test_rotation_keeps_the_old_token_for_the_grace_only(tmp_path: Path) -> None:
    path = tmp_path / "credentials.toml"
    old = add_principal(path, "acme")
    new = rotate_token(path, "acme", grace_s=60)
    now_s = time.time()
    assert _principal(path, new, now_s).name == "acme"
    assert _principal(path, old, now_s).name == "acme", "the old token died before its grace"
    assert _principal(path, old, now_s + 61) is None, "the old token outlived its grace"
    newest = rotate_token(path, "acme", grace_s=0)
    assert _principal(path, new, now_s) is None, "grace 0 kept the previous token"
    assert _principal(path, old, now_s) is None, "a token two rotations old still works"
    assert _principal(path, newest, now_s).name == "acme"
    with pytest.raises(ValueError, match="no principal"):
        rotate_token(path, "nobody")


def test_a_node_certificate_never_stands_for_a_tenant(tmp_path: Path) -> None:
    path = tmp_path / "credentials.toml"
    add_principal(path, "acme", cert_identity="n03")
    auth = Authenticator(path)
    assert auth.authenticate(None, PeerCertificate("n03", None)).name == "acme"
    with pytest.raises(PermissionDenied):
        auth.authenticate(None, PeerCertificate("n03", "n03"))


def test_node_credential_needs_a_member_nodes_certificate_under_mtls(tmp_path: Path) -> None:
    path = tmp_path / "credentials.toml"
    node_token = add_principal(path, "nodes", Role.NODE)
    tenant_token = add_principal(path, "acme")
    auth = Authenticator(path)
    node = auth.authenticate(node_token)
    peers = NodePeers(True, lambda: {"n00", "n01"})
    peers.check(node, PeerCertificate("n01", "n01"))
    for cert in (None, PeerCertificate("acme", None), PeerCertificate("n99", "n99")):
        with pytest.raises(PermissionDenied):
            peers.check(node, cert)
    peers.check(auth.authenticate(tenant_token), None)  # other roles are not its business
    NodePeers(False, frozenset).check(node, None)  # without mTLS the token alone proves it


def test_token_file_is_read_again_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "node.token"
    write_private(path, "kvst_first")
    token_file = TokenFile(path)
    assert token_file.metadata() == (("authorization", "Bearer kvst_first"),)
    write_private(path, "kvst_second")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a visibly newer file
    token_file._checked_s = -1e9  # the once-a-second check is due
    assert token_file.current() == "kvst_second", "a rotated token file was not picked up"
    assert TokenFile(None).metadata() is None
