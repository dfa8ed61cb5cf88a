"""API keys of the HTTP front: which tenant a bearer key speaks for.

``kvstore serve --api-keys FILE`` reads a TOML file with one ``[keys]`` table::

    [keys]
    "sk-acme-1" = "acme"       # KEY = TENANT; several keys may share a tenant
    "sk-globex" = "globex"

Without the file there is no authentication and every request is tenant ``default``. The
tenant is decided here, from the credential, never from the request body: it salts the block
keys (so one tenant's prompts never hit, and never time, another's) and the store checks it
on every shard. Keys are held as SHA-256 digests, so looking one up compares no secret bytes.
"""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path

from kvstore.errors import InvalidArgument, PermissionDenied

DEFAULT_TENANT = "default"


class ApiKeys:
    """Bearer key -> tenant; ``ApiKeys(None)`` means no authentication (tenant ``default``)."""

    def __init__(self, key_to_tenant: dict[str, str] | None) -> None:
        self.enabled = key_to_tenant is not None
        self._digest_to_tenant = {_digest(k): t for k, t in (key_to_tenant or {}).items()}

    @classmethod
    def load(cls, path: str | Path | None) -> ApiKeys:
        """Keys from ``path`` (see the module doc), or no authentication for None."""
        if path is None:
            return cls(None)
        try:
            raw = tomllib.loads(Path(path).read_text())
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
                    f"{path}: key {key[:4]}...: the tenant must be a non-empty string, got "
                    f"{tenant!r}"
                )
        return cls(dict(keys))

    def tenant(self, authorization: str | None) -> str:
        """The tenant of an ``Authorization: Bearer KEY`` header; PermissionDenied if the
        key is missing or unknown (while keys are configured)."""
        if not self.enabled:
            return DEFAULT_TENANT
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise PermissionDenied("missing API key: send the header 'Authorization: Bearer KEY'")
        tenant = self._digest_to_tenant.get(_digest(key.strip()))
        if tenant is None:
            raise PermissionDenied("incorrect API key provided")
        return tenant


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
