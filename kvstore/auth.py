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
    token_expires_unix_s = 1.8e9  # optional: the token is refused from then on
    retiring_token_sha256 = "..." # optional: the token before the last rotation...
    retiring_until_unix_s = 1.7e9 # ...still accepted until then (kvstore cluster rotate-token)
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
``$KVSTORE_TOKEN_FILE`` (:func:`client_token`), never from cluster.toml; nodes read theirs
from ``peer_token_file`` (:class:`TokenFile`, re-read when it changes).

Rotation (:func:`rotate_token`, ``kvstore cluster rotate-token``): a principal gets a new
token and its old one stays valid for a grace period, so holders switch without an outage.

The node credential. A node principal reads any tenant's shards and writes repairs, so where
its token may come from matters: under mutual TLS a node token is accepted only on a
connection whose client certificate is a node's (kvstore/certs.py) naming a member of the
current map (:class:`NodePeers`); a node's certificate never stands for a tenant, service or
admin. Without mutual TLS the token alone proves it: keep ``node.token`` on the node hosts.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import functools
import hashlib
import logging
import os
import secrets
import stat
import threading
import time
import tomllib
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomli_w

from kvstore.errors import InvalidArgument, PermissionDenied, quoted
from ttl.units import parse_duration_s

if TYPE_CHECKING:
    from kvstore.tls import PeerCertificate

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
    token_expires_unix_s: float = 0.0  # 0 = the token never expires
    retiring_token_sha256: str = ""  # the previous token, during a rotation's grace period
    retiring_until_unix_s: float = 0.0

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
                    f"credential of tenant {self.name!r} used for tenant {quoted(claimed)}: a "
                    "tenant may only touch its own blocks"
                )
            return self.name
        if self.role is Role.SERVICE:
            if not claimed:
                raise InvalidArgument(
                    f"service {self.name!r} must name the tenant it acts for in the request"
                )
            if claimed not in self.tenants and ANY_TENANT not in self.tenants:
                raise PermissionDenied(
                    f"service {self.name!r} may not act for tenant {quoted(claimed)} (its "
                    f"allow-list: {', '.join(sorted(self.tenants))}); add it in the credentials "
                    "file"
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
        by_digest = {p.retiring_token_sha256: p for p in self.principals}
        by_digest |= {p.token_sha256: p for p in self.principals}
        by_digest.pop("", None)
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

    def by_token(self, token: str, now_unix_s: float) -> Principal | None:
        """The principal ``token`` authenticates at ``now_unix_s`` (None: unknown or expired)."""
        principal = self._digest_to_principal.get(digest := token_digest(token))
        if principal is None:
            return None
        if digest == principal.token_sha256:
            expires_s = principal.token_expires_unix_s
        else:
            expires_s = principal.retiring_until_unix_s
        return principal if not expires_s or now_unix_s < expires_s else None

    @functools.cached_property
    def known_tenants(self) -> frozenset[str]:
        """The tenants this file names: tenant principals and services' allow-lists."""
        names = {p.name for p in self.principals if p.role is Role.TENANT}
        names.update(t for p in self.principals if p.role is Role.SERVICE for t in p.tenants)
        return frozenset(names - {ANY_TENANT})

    def by_cert(self, identity: str) -> Principal | None:
        return next((p for p in self.principals if p.cert_identity == identity), None)


def new_token() -> str:
    """A fresh bearer token: 256 random bits."""
    return _TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


_TOKEN_FIELDS = (
    "token_sha256",
    "token_expires_unix_s",
    "retiring_token_sha256",
    "retiring_until_unix_s",
)


def _principal_from_toml(raw: Mapping[str, Any]) -> Principal:
    known = {"name", "role", "tenants", "cert_identity", *_TOKEN_FIELDS}
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
        token_expires_unix_s=float(raw.get("token_expires_unix_s", 0.0)),
        retiring_token_sha256=str(raw.get("retiring_token_sha256", "")),
        retiring_until_unix_s=float(raw.get("retiring_until_unix_s", 0.0)),
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
        for name in ("cert_identity", *_TOKEN_FIELDS):
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
def locked(path: Path) -> Iterator[None]:
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
    expires_in_s: float = 0.0,
) -> str:
    """Add (or re-key) principal ``name`` in the credentials file; return its new token,
    valid for ``expires_in_s`` (0: until rotated).

    Only the token's digest is stored: the token is shown once, to the caller.
    """
    path = Path(path)
    token = new_token()
    with locked(path):
        creds = load_credentials(path) if path.exists() else Credentials()
        principal = Principal(
            name,
            role,
            tenants,
            token_digest(token),
            cert_identity,
            token_expires_unix_s=_expiry(expires_in_s),
        )
        kept = tuple(p for p in creds.principals if p.name != name)
        creds = replace(creds, principals=(*kept, principal))
        write_private(path, tomli_w.dumps(credentials_to_dict(creds)))
    return token


def rotate_token(
    path: str | Path, name: str, *, grace_s: float = 600.0, expires_in_s: float = 0.0
) -> str:
    """A new token for principal ``name``; its current one stays valid ``grace_s`` longer (0:
    refused at once; a token still retiring from an earlier rotation goes now). The new token
    is valid for ``expires_in_s`` (0: until rotated). ValueError if there is no such principal.
    """
    if grace_s < 0 or expires_in_s < 0:
        raise ValueError(f"grace and expiry must be >= 0 s, got {grace_s} and {expires_in_s}")
    path = Path(path)
    token = new_token()
    with locked(path):
        creds = load_credentials(path)
        old = next((p for p in creds.principals if p.name == name), None)
        if old is None:
            names = ", ".join(p.name for p in creds.principals)
            raise ValueError(f"no principal {name!r} in {path} (it has: {names})")
        until_s = time.time() + grace_s
        if old.token_expires_unix_s:
            until_s = min(until_s, old.token_expires_unix_s)
        new = replace(
            old,
            token_sha256=token_digest(token),
            token_expires_unix_s=_expiry(expires_in_s),
            retiring_token_sha256=old.token_sha256 if grace_s else "",
            retiring_until_unix_s=until_s if grace_s else 0.0,
        )
        principals = tuple(new if p.name == name else p for p in creds.principals)
        creds = replace(creds, principals=principals)
        write_private(path, tomli_w.dumps(credentials_to_dict(creds)))
    return token


def _expiry(expires_in_s: float) -> float:
    return time.time() + expires_in_s if expires_in_s else 0.0


def set_tenant_caps(path: str | Path, tenant: str, class_to_max_ttl_s: Mapping[str, float]) -> None:
    """Set the retention caps of ``tenant`` (empty: none) in the credentials file."""
    path = Path(path)
    with locked(path):
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

    def authenticate(self, token: str | None, cert: PeerCertificate | None = None) -> Principal:
        """The principal behind a request's credential; PermissionDenied if none is valid.

        A verified client certificate whose common name some principal claims wins over a
        token (a node's certificate never does: it stands for no tenant, service or admin);
        otherwise the bearer token decides, if it has not expired.
        """
        if self.path is None:
            return OPEN_PRINCIPAL
        creds = self.current()
        by_cert = creds.by_cert(cert.common_name) if cert and cert.node_id is None else None
        if by_cert is not None:
            return by_cert
        if token and (principal := creds.by_token(token, time.time())) is not None:
            return principal
        what = "wrong or expired token" if token else "no credential"
        raise PermissionDenied(
            f"{what}: send metadata ('authorization', 'Bearer <token>') with a token from "
            "`kvstore cluster add-tenant` (or `rotate-token`), or a client certificate the "
            "credentials file names"
        )


class NodePeers:
    """Where the node credential is accepted (module doc): with ``require_cert`` (mutual TLS)
    only with a node's certificate naming one of ``members()``, the current map's node ids."""

    def __init__(self, require_cert: bool, members: Callable[[], Collection[str]]) -> None:
        self.require_cert = require_cert
        self._members = members

    def check(self, principal: Principal, cert: PeerCertificate | None) -> None:
        """PermissionDenied when a node principal comes without a member node's certificate."""
        if principal.role is not Role.NODE or not self.require_cert:
            return
        if cert is None or cert.node_id is None:
            who = (
                "no certificate"
                if cert is None
                else f"client certificate {quoted(cert.common_name)}"
            )
            raise PermissionDenied(
                f"the node credential came with {who}: under mutual TLS it is accepted only "
                "from a node, with its node certificate (`kvstore certs issue --node`)"
            )
        if cert.node_id not in self._members():
            raise PermissionDenied(
                f"node {cert.node_id!r} is not a member of this node's cluster map: the node "
                "credential is accepted only from the map's nodes"
            )


class TokenFile:
    """A token in a file (``peer_token_file``), re-read when the file changes (checked at
    most once a second), so a rotated node token is picked up without a restart."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        self._mtime_ns = -1
        self._checked_s = -RELOAD_CHECK_S
        self._token: str | None = None
        self.current()  # a missing or unsafe file fails at start, not at the first call

    def current(self) -> str | None:
        if self.path is None:
            return None
        now_s = time.monotonic()
        if now_s - self._checked_s >= RELOAD_CHECK_S:
            self._checked_s = now_s
            mtime_ns = self.path.stat().st_mtime_ns
            if mtime_ns != self._mtime_ns:
                self._token, self._mtime_ns = read_token_file(self.path), mtime_ns
        return self._token

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """gRPC call metadata carrying the token, or None without one."""
        token = self.current()
        return (("authorization", f"Bearer {token}"),) if token else None


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
