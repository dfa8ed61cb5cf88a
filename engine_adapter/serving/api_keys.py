"""Keys of the HTTP front: which tenant a bearer key speaks for, and the admin key.

``kvstore serve --api-keys FILE`` reads a TOML file with one ``[keys]`` table::

    [keys]
    "sk-acme-1" = "acme"       # KEY = TENANT; several keys may share a tenant
    "sk-globex" = "globex"

``--api-key KEY`` (as ``vllm serve``'s, repeatable) adds a key for tenant ``default``. With
neither there is no authentication and every request is tenant ``default``. The tenant is
decided here, from the credential, never from the request body: it salts the block keys (so
one tenant's prompts never hit, and never time, another's) and the store checks it on every
shard.

The admin key (``--admin-key-file``; ``kvstore serve`` makes one, mode 0600, where none
exists) is the only credential ``/admin/*`` takes, and it is no API key: it cannot make
requests. Keys are held as SHA-256 digests, so looking one up compares no secret bytes.
"""

from __future__ import annotations

import hashlib
import secrets
import tomllib
from collections.abc import Sequence
from pathlib import Path

from kvstore.auth import write_private
from kvstore.errors import InvalidArgument, PermissionDenied

DEFAULT_TENANT = "default"
ADMIN_KEY_PREFIX = "sk-admin-"


class ApiKeys:
    """Bearer key -> tenant; ``ApiKeys(None)`` means no authentication (tenant ``default``).
    ``admin_key`` (None: none) is the one key ``/admin/*`` accepts."""

    def __init__(self, key_to_tenant: dict[str, str] | None, admin_key: str | None = None):
        self.enabled = key_to_tenant is not None
        self._digest_to_tenant = {_digest(k): t for k, t in (key_to_tenant or {}).items()}
        self._admin_digest = _digest(admin_key) if admin_key else None
        if self._admin_digest is not None and self._admin_digest in self._digest_to_tenant:
            raise InvalidArgument("the admin key is also an API key; give each its own key")

    @classmethod
    def load(
        cls, path: str | Path | None, keys: Sequence[str] = (), admin_key: str | None = None
    ) -> ApiKeys:
        """Keys from ``path`` (see the module doc) and ``keys`` (tenant ``default``), or no
        authentication when there are none."""
        key_to_tenant = _read_key_file(Path(path)) if path is not None else {}
        for key in keys:
            if not key.strip():
                raise InvalidArgument("--api-key: an API key may not be empty")
            key_to_tenant[key.strip()] = DEFAULT_TENANT
        return cls(key_to_tenant if path is not None or keys else None, admin_key)

    def tenant(self, authorization: str | None) -> str:
        """The tenant of an ``Authorization: Bearer KEY`` header; PermissionDenied if the
        key is missing or unknown (while keys are configured)."""
        if not self.enabled:
            return DEFAULT_TENANT
        tenant = self._digest_to_tenant.get(_digest(_bearer(authorization)))
        if tenant is None:
            raise PermissionDenied("incorrect API key provided")
        return tenant

    def check_admin(self, authorization: str | None) -> None:
        """PermissionDenied unless the header carries the admin key."""
        if self._admin_digest is None:
            raise PermissionDenied("this server has no admin key: start it with --admin-key-file")
        if not secrets.compare_digest(_digest(_bearer(authorization)), self._admin_digest):
            raise PermissionDenied("incorrect admin key provided")


def _read_key_file(path: Path) -> dict[str, str]:
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InvalidArgument(f"cannot read the API key file {path}: {exc}") from None
    keys = raw.get("keys")
    if not isinstance(keys, dict) or not keys:
        raise InvalidArgument(
            f'{path}: expected a [keys] table of "KEY" = "TENANT" entries, e.g.\n'
            '[keys]\n"sk-acme-1" = "acme"'
        )
    for key, tenant in keys.items():
        if not isinstance(tenant, str) or not tenant or "\0" in tenant or not key.strip():
            raise InvalidArgument(
                f"{path}: key {key[:4]}...: the tenant must be a non-empty string, got {tenant!r}"
            )
    return dict(keys)


def admin_key(path: Path) -> str:
    """The admin key in ``path``; a new random one is written there (mode 0600) if the file
    does not exist."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private(path, ADMIN_KEY_PREFIX + secrets.token_urlsafe(24) + "\n")
    try:
        key = path.read_text().strip()
    except OSError as exc:
        raise InvalidArgument(f"cannot read the admin key file {path}: {exc}") from None
    if not key:
        raise InvalidArgument(f"the admin key file {path} is empty; delete it to get a new key")
    return key


def _bearer(authorization: str | None) -> str:
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise PermissionDenied("missing API key: send the header 'Authorization: Bearer KEY'")
    return key.strip()


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
