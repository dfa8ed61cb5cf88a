"""Principals: who a request comes from, what it may do, and the server-side credentials file.

A node never trusts the tenant a request names. It derives the caller from a credential (a
bearer token, or the common name of a verified mTLS client certificate) and then decides::

    role     data RPCs (put, get, contains, delete,        Stats  Purge  ListTombstones
             touch) and QueueRepair                                       ListShards
    -------  -------------------------------------------  -----  -----  --------------
    tenant   its own tenant only (the principal's name)     -      -      -
    service  the tenants of its allow-list (``*``: any)    -      -      -
    node     any tenant's get/batch read, repair puts       yes    -      yes (peer sync,
             and QueueRepair; no other data RPC                           repair listing)
    admin    -                                              yes    yes    yes

A data request that names another tenant gets PERMISSION_DENIED; a tenant principal may
leave the tenant empty and gets its own. Health stays open (it tells only id, epoch, clock,
serving state, incarnation and the local read socket).

The credentials file lives on the nodes only (never in cluster.toml, which every client
reads), mode 0600, tokens stored as SHA-256 digests::

    [[principals]]
    name = "acme"                 # a tenant principal: the tenant it is
    role = "tenant"
    token_sha256 = "9f2c..."      # hex digest of the token (kvstore cluster add-tenant)
    cert_identity = "acme"        # optional: CN of its mTLS client certificate
    [[principals]]
    name = "serving"
    role = "service"
    tenants = ["acme", "globex"]
    token_sha256 = "..."
    [tenants.acme]                # retention caps, enforced by the nodes (ttl/policy.py)
    max_ttl_s = { chat = "1d", agent = "12h" }

Why a plain SHA-256 and not a slow password hash: tokens are 256 random bits made by
:func:`new_token`, so there is no dictionary to search; a digest that leaks does not give
the token, and a lookup costs one hash per request. Nodes re-read the file when it changes
(checked at most once a second), so ``add-tenant`` needs no restart.

Clients read their token from an argument, ``$KVSTORE_TOKEN`` or the file named by
``$KVSTORE_TOKEN_FILE`` (:func:`client_token`), never from cluster.toml.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import hashlib
import logging
import os
import secrets
import stat
import threading
import time
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import tomli_w

from kvstore.errors import InvalidArgument, PermissionDenied
from ttl.units import parse_duration_s

log = logging.getLogger(__name__)

TOKEN_ENV = "KVSTORE_TOKEN"
TOKEN_FILE_ENV = "KVSTORE_TOKEN_FILE"
RELOAD_CHECK_S = 1.0
ANY_TENANT = "*"
_TOKEN_PREFIX = "kvst_"


class Role(enum.Enum):
    TENANT = "tenant"
    SERVICE = "service"
    NODE = "node"
    ADMIN = "admin"
    OPEN = "open"  # auth off: no credentials file; the claimed tenant is believed


@dataclass(frozen=True)
class Principal:
    """One identity of the credentials file (or the open principal when auth is off)."""

    name: str
    role: Role
    tenants: frozenset[str] = frozenset()  # service: the tenants it may act for
    token_sha256: str = ""
    cert_identity: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a principal needs a non-empty name")
        if self.role is Role.SERVICE and not self.tenants:
            raise ValueError(
                f"service principal {self.name!r} has an empty tenants allow-list; list the "
                f"tenants it serves, or {ANY_TENANT!r} for any"
            )

    def tenant_for(self, claimed: str) -> str:
        """The tenant a data request acts for: derived from the credential, never believed.

        Raises PermissionDenied when the request names a tenant this principal may not act
        for, or the role has no data access.
        """
        if self.role is Role.OPEN:
            return claimed
        if self.role is Role.TENANT:
            if claimed and claimed != self.name:
                raise PermissionDenied(
                    f"credential of tenant {self.name!r} used for tenant {claimed!r}: a tenant "
                    "may only touch its own blocks"
                )
            return self.name
        if self.role is Role.SERVICE:
            if not claimed:
                raise InvalidArgument(
                    f"service {self.name!r} must name the tenant it acts for in the request"
                )
            if claimed not in self.tenants and ANY_TENANT not in self.tenants:
                raise PermissionDenied(
                    f"service {self.name!r} may not act for tenant {claimed!r} (its allow-list: "
                    f"{', '.join(sorted(self.tenants))}); add it in the credentials file"
                )
            return claimed
        raise PermissionDenied(
            f"principal {self.name!r} has role {self.role.value}: data calls need a tenant or "
            "service credential"
        )

    def tenant_for_repair(self, claimed: str) -> str:
        """As :meth:`tenant_for`, and a node principal may act for any tenant: a peer's repair
        service reads survivors' shards and writes rebuilt ones (kvstore/node/repair_service.py),
        and a node holds every tenant's shards on its own disk anyway."""
        if self.role is Role.NODE:
            return claimed
        return self.tenant_for(claimed)

    def require(self, *roles: Role) -> None:
        """Raise PermissionDenied unless this principal has one of ``roles`` (or auth is off)."""
        if self.role is not Role.OPEN and self.role not in roles:
            names = " or ".join(r.value for r in roles)
            raise PermissionDenied(
                f"principal {self.name!r} has role {self.role.value}; this call needs {names}"
            )


OPEN_PRINCIPAL = Principal("anonymous", Role.OPEN)


@dataclass(frozen=True)
class Credentials:
    """The parsed credentials file: principals and per-tenant retention caps."""

    principals: tuple[Principal, ...] = ()
    tenant_to_max_ttl_s: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    _digest_to_principal: dict[str, Principal] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_digest = {p.token_sha256: p for p in self.principals if p.token_sha256}
        object.__setattr__(self, "_digest_to_principal", by_digest)
        names = [p.name for p in self.principals]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate principal names in the credentials file: {names}")
        for tenant, caps in self.tenant_to_max_ttl_s.items():
            for traffic_class, cap_s in caps.items():
                if not cap_s > 0:
                    raise ValueError(
                        f"[tenants.{tenant}] max_ttl_s.{traffic_class} must be > 0, got {cap_s}"
                    )

    def by_token(self, token: str) -> Principal | None:
        return self._digest_to_principal.get(token_digest(token))

    def by_cert(self, identity: str) -> Principal | None:
        return next((p for p in self.principals if p.cert_identity == identity), None)


def new_token() -> str:
    """A fresh bearer token: 256 random bits."""
    return _TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _principal_from_toml(raw: Mapping[str, Any]) -> Principal:
    known = {"name", "role", "tenants", "token_sha256", "cert_identity"}
    if unknown := set(raw) - known:
        raise ValueError(f"unknown principal keys {sorted(unknown)}; known: {sorted(known)}")
    try:
        role = Role(raw.get("role", ""))
    except ValueError:
        roles = [r.value for r in Role if r is not Role.OPEN]
        raise ValueError(f"principal {raw.get('name')!r}: role must be one of {roles}") from None
    if role is Role.OPEN:
        raise ValueError("role 'open' is what a node without a credentials file uses")
    return Principal(
        name=str(raw.get("name", "")),
        role=role,
        tenants=frozenset(raw.get("tenants", ())),
        token_sha256=str(raw.get("token_sha256", "")),
        cert_identity=str(raw.get("cert_identity", "")),
    )


def credentials_from_dict(raw: Mapping[str, Any]) -> Credentials:
    caps = {
        tenant: {cls: parse_duration_s(v) for cls, v in entry.get("max_ttl_s", {}).items()}
        for tenant, entry in raw.get("tenants", {}).items()
    }
    principals = tuple(_principal_from_toml(p) for p in raw.get("principals", []))
    return Credentials(principals, caps)


def credentials_to_dict(creds: Credentials) -> dict[str, Any]:
    principals = []
    for p in creds.principals:
        record: dict[str, Any] = {"name": p.name, "role": p.role.value}
        if p.tenants:
            record["tenants"] = sorted(p.tenants)
        for name in ("token_sha256", "cert_identity"):
            if value := getattr(p, name):
                record[name] = value
        principals.append(record)
    tenants = {t: {"max_ttl_s": dict(c)} for t, c in creds.tenant_to_max_ttl_s.items() if c}
    return {"principals": principals, "tenants": tenants}


def check_private(path: Path) -> None:
    """Raise ValueError unless only the owner may read ``path`` (like ssh with its keys)."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise ValueError(
            f"{path} has mode {mode:o}: it holds secrets, so only its owner may read it; "
            f"run `chmod 600 {path}`"
        )


def load_credentials(path: str | Path) -> Credentials:
    """Read and validate the credentials file; errors name the file."""
    path = Path(path)
    try:
        check_private(path)
        return credentials_from_dict(tomllib.loads(path.read_text()))
    except FileNotFoundError:
        raise ValueError(
            f"no credentials file at {path}; create it with `kvstore cluster add-tenant`"
        ) from None
    except (tomllib.TOMLDecodeError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from exc


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, readable by its owner only (mode 0600)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o600)
    tmp.replace(path)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock beside ``path``: concurrent add-tenant calls never lose an entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def add_principal(
    path: str | Path,
    name: str,
    role: Role = Role.TENANT,
    tenants: frozenset[str] = frozenset(),
    *,
    cert_identity: str = "",
) -> str:
    """Add (or re-key) principal ``name`` in the credentials file; return its new token.

    Only the token's digest is stored: the token is shown once, to the caller.
    """
    path = Path(path)
    token = new_token()
    with _locked(path):
        creds = load_credentials(path) if path.exists() else Credentials()
        principal = Principal(name, role, tenants, token_digest(token), cert_identity)
        kept = tuple(p for p in creds.principals if p.name != name)
        creds = replace(creds, principals=(*kept, principal))
        write_private(path, tomli_w.dumps(credentials_to_dict(creds)))
    return token


def set_tenant_caps(path: str | Path, tenant: str, class_to_max_ttl_s: Mapping[str, float]) -> None:
    """Set the retention caps of ``tenant`` (empty: none) in the credentials file."""
    path = Path(path)
    with _locked(path):
        creds = load_credentials(path) if path.exists() else Credentials()
        caps = dict(creds.tenant_to_max_ttl_s)
        caps[tenant] = dict(class_to_max_ttl_s)
        write_private(
            path, tomli_w.dumps(credentials_to_dict(replace(creds, tenant_to_max_ttl_s=caps)))
        )


class Authenticator:
    """A node's view of its credentials file, re-read when the file changes.

    ``path`` empty means auth is off: every caller is :data:`OPEN_PRINCIPAL`. A file that
    turns invalid while the node runs is logged and the last good version kept.
    """

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        self._checked_s = 0.0
        self._mtime_ns = -1
        self.credentials = Credentials()
        if self.path is not None:
            self.credentials = load_credentials(self.path)
            self._mtime_ns = self.path.stat().st_mtime_ns
            self._checked_s = time.monotonic()

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def current(self) -> Credentials:
        """The credentials, re-read if the file changed (checked at most once a second)."""
        if self.path is None:
            return self.credentials
        now_s = time.monotonic()
        if now_s - self._checked_s < RELOAD_CHECK_S:
            return self.credentials
        with self._lock:
            self._checked_s = now_s
            try:
                mtime_ns = self.path.stat().st_mtime_ns
                if mtime_ns != self._mtime_ns:
                    self.credentials = load_credentials(self.path)
                    self._mtime_ns = mtime_ns
                    log.info("reloaded credentials from %s", self.path)
            except (OSError, ValueError) as exc:
                log.error("keeping the previous credentials: %s", exc)
        return self.credentials

    def authenticate(self, token: str | None, cert_identity: str | None = None) -> Principal:
        """The principal behind a request's credential; PermissionDenied if none is valid.

        A verified client certificate whose common name some principal claims wins over a
        token; otherwise the bearer token decides.
        """
        if self.path is None:
            return OPEN_PRINCIPAL
        creds = self.current()
        if cert_identity and (principal := creds.by_cert(cert_identity)) is not None:
            return principal
        if token and (principal := creds.by_token(token)) is not None:
            return principal
        what = "wrong token" if token else "no credential"
        raise PermissionDenied(
            f"{what}: send metadata ('authorization', 'Bearer <token>') with a token from "
            "`kvstore cluster add-tenant`, or a client certificate the credentials file names"
        )


def bearer_token(metadata: Mapping[str, Any]) -> str | None:
    """The token of an ``authorization: Bearer <token>`` header, or None."""
    offered = metadata.get("authorization")
    if isinstance(offered, bytes):
        offered = offered.decode(errors="replace")
    if isinstance(offered, str) and offered.startswith("Bearer "):
        return offered[len("Bearer ") :]
    return None


def read_token_file(path: str | Path) -> str:
    """The token stored in ``path`` (one line); ValueError if missing, empty or readable by
    others."""
    path = Path(path)
    try:
        check_private(path)
        token = path.read_text().strip()
    except FileNotFoundError:
        raise ValueError(f"no token file at {path}") from None
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def client_token(token: str | None) -> str | None:
    """A client's token: the argument, else ``$KVSTORE_TOKEN``, else the file named by
    ``$KVSTORE_TOKEN_FILE``, else None (for clusters without auth)."""
    if token:
        return token
    if env := os.environ.get(TOKEN_ENV):
        return env
    if path := os.environ.get(TOKEN_FILE_ENV):
        return read_token_file(path)
    return None
