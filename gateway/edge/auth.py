"""API keys: bearer tokens mapped to tenants, each with its own cache salt.

The keys file is JSON: ``{"<key>": {"tenant": "acme", "cache_salt": "..."}}``
(``cache_salt`` defaults to the tenant name; a bare string value is the
tenant). The salt is sent to the worker and folded into the block hashes, so
two tenants never share a cached block. Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Tenant:
    """Who a request belongs to, for cache isolation and session scoping."""

    name: str = ""
    cache_salt: str = ""


ANONYMOUS = Tenant()


class ApiKeys:
    """Looks up the tenant of a bearer token."""

    def __init__(self, keys: dict[str, Tenant]) -> None:
        if not keys:
            raise ValueError("--api-keys-file holds no keys")
        self._keys = [(k.encode(), t) for k, t in keys.items()]

    @classmethod
    def load(cls, path: Path) -> ApiKeys:
        """Reads a keys file; ``ValueError`` naming ``--api-keys-file`` when malformed."""
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
            keys[key] = Tenant(tenant, str(value.get("cache_salt", tenant)))
        return cls(keys)

    def tenant_for(self, authorization: str | None) -> Tenant | None:
        """The tenant of an ``Authorization: Bearer <key>`` header, None if not valid."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        given = authorization[len("Bearer ") :].strip().encode()
        found: Tenant | None = None
        # Compare against every key, so the time taken does not reveal which one matched.
        for key, tenant in self._keys:
            if hmac.compare_digest(key, given):
                found = tenant
        return found
