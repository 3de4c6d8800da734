"""API keys: bearer tokens mapped to tenants, each with its own cache salt.

The keys file is JSON: ``{"<key>": {"tenant": "acme", "cache_salt": "..."}}``
(a bare string value is the tenant). The salt is sent to the worker and folded
into the block hashes, so two tenants never share a cached block. Without a
``cache_salt`` in the file it is ``HMAC-SHA256(secret, tenant)``, the secret
being ``--tenant-salt-secret`` (``KVROUTE_TENANT_SALT_SECRET``, a Kubernetes
Secret in the chart): a salt nobody can guess from a tenant's name, so no one
who reaches a worker's port can probe another tenant's cache with it. Every
gateway replica needs the same secret (or their hashes, and so routing, differ).
Keys are compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tenant:
    """Who a request belongs to, for cache isolation and session scoping."""

    name: str = ""
    cache_salt: str = ""


ANONYMOUS = Tenant()


def tenant_salt(secret: bytes, tenant: str) -> str:
    """The cache salt of ``tenant``: an HMAC of its id under the server-side secret."""
    return hmac.new(secret, tenant.encode("utf-8"), hashlib.sha256).hexdigest()[:32]


class ApiKeys:
    """Looks up the tenant of a bearer token."""

    def __init__(self, keys: dict[str, Tenant]) -> None:
        if not keys:
            raise ValueError("--api-keys-file holds no keys")
        self._keys = [(k.encode(), t) for k, t in keys.items()]

    @classmethod
    def load(cls, path: Path, salt_secret: str = "") -> ApiKeys:
        """Reads a keys file; ``ValueError`` naming ``--api-keys-file`` when malformed.

        Salts not given in the file are derived from ``salt_secret``; without
        one a random secret is drawn (salts then change on every restart and
        differ between replicas: isolation holds, cache reuse does not).
        """
        if salt_secret:
            secret = salt_secret.encode("utf-8")
        else:
            secret = secrets.token_bytes(32)
            logger.warning(
                "--tenant-salt-secret is not set: tenant cache salts use a random secret, so "
                "they change on restart and differ between gateway replicas"
            )
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"--api-keys-file {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError(f"--api-keys-file {path}: expected a JSON object of key -> tenant")
        keys: dict[str, Tenant] = {}
        for key, value in raw.items():
            if isinstance(value, str):
                value = {"tenant": value}
            if not key or not isinstance(value, dict) or not value.get("tenant"):
                raise ValueError(f"--api-keys-file {path}: each key needs a tenant")
            tenant = str(value["tenant"])
            salt = value.get("cache_salt")
            keys[key] = Tenant(tenant, str(salt) if salt else tenant_salt(secret, tenant))
        return cls(keys)

    def tenant_for(self, authorization: str | None) -> Tenant | None:
        """The tenant of an ``Authorization: Bearer <key>`` header, None if not valid."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        # aiohttp hands undecodable header bytes over as surrogate escapes: keep them
        # as bytes (they match no key) instead of failing to encode them.
        given = authorization[len("Bearer ") :].strip().encode("utf-8", "surrogateescape")
        found: Tenant | None = None
        # Compare against every key, so the time taken does not reveal which one matched.
        for key, tenant in self._keys:
            if hmac.compare_digest(key, given):
                found = tenant
        return found
