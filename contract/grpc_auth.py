"""The shared token gateways and workers authenticate each other's calls with.

With ``--grpc-token-file`` set on both sides, every gRPC call from a gateway
carries ``authorization: Bearer <token>`` metadata and the worker refuses any
call without it (``UNAUTHENTICATED``); the worker's HTTP front wants the same
header. The file is read once at start-up; surrounding whitespace (the newline
``echo`` or an editor leaves) is ignored. Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac
from pathlib import Path

METADATA_KEY = "authorization"  # gRPC metadata keys are lower case
MIN_TOKEN_CHARS = 16
_PREFIX = "Bearer "


def read_token_file(path: Path) -> str:
    """The token in ``path``; ``ValueError`` saying why when it is missing or unusable.

    The message gives the reason only: callers prefix the flag and the path.
    """
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the token ({exc})") from exc
    if not token:
        raise ValueError("the file is empty (write a token into it)")
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"the token has {len(token)} characters; use at least {MIN_TOKEN_CHARS} "
            "(e.g. openssl rand -hex 32)"
        )
    # It travels as an HTTP/2 header value: visible ASCII, no spaces.
    if not all("!" <= c <= "~" for c in token):
        raise ValueError("the token must be printable ASCII without spaces")
    return token


def bearer(token: str) -> str:
    """The ``authorization`` value that carries ``token``."""
    return _PREFIX + token


def is_bearer(value: str | None, token: str) -> bool:
    """Whether ``value`` (an ``authorization`` header or metadata value) carries ``token``.

    Constant time in the given value's content, so timing does not reveal how
    much of a guess was right.
    """
    if not value or not value.startswith(_PREFIX):
        return False
    # Undecodable bytes from an HTTP front arrive as surrogate escapes: keep them as
    # bytes (they never match) instead of failing to encode them.
    given = value[len(_PREFIX) :].strip().encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, token.encode("ascii"))
