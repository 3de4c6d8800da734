"""Redis connection URLs as both sides build and log them.

Deployments keep the Redis password in a Secret exposed as the environment
variable ``KVROUTE_REDIS_PASSWORD``, never inside ``--redis-url``; each CLI
folds it into the URL once at start-up. Logs only ever see ``redact``'s form.
"""

from __future__ import annotations

from urllib.parse import quote, urlsplit, urlunsplit

PASSWORD_ENV = "KVROUTE_REDIS_PASSWORD"


def with_password(url: str, password: str | None) -> str:
    """``url`` with ``password`` set (kept as is when ``password`` is empty)."""
    if not password:
        return url
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"--redis-url {redact(url)!r}: a password needs redis:// or rediss://")
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{quote(parts.username or '', safe='')}:{quote(password, safe='')}@{host}"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***``, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, parts.fragment))
