"""Typed reads of a decoded JSON request body's fields, each failing as a 400 that names it.

Every OpenAI body parser (``openai_api.sampling``, ``openai_api.messages``,
``openai_api.requests``) reads its parameters through these, so a wrong type
or an out-of-range value is refused the same way everywhere: ``APIError(400)``
with ``param`` set to the offending field and ``code="invalid_value"``.
"""

from __future__ import annotations

import math
from typing import Any

from openai_api.errors import APIError

MAX_TOKEN_ID = 2**32  # token ids travel as uint32 (proto); anything larger is a 400 here


def bad_value(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def number_field(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_value(f"'{name}' must be a number", name)
    if not lo <= value <= hi:
        raise bad_value(f"'{name}' must be between {lo} and {hi}, got {value}", name)
    return float(value)


def int_field(body: dict[str, Any], name: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_value(f"'{name}' must be an integer", name)
    if value < lo or (hi is not None and value > hi):
        raise bad_value(f"'{name}' must be >= {lo}" + (f" and <= {hi}" if hi else ""), name)
    return value


def bool_field(body: dict[str, Any], name: str, *, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_value(f"'{name}' must be a boolean", name)
    return value


def token_ids_field(value: Any, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < MAX_TOKEN_ID for t in value
    ):
        raise bad_value(f"'{name}' must be a list of token ids (integers 0 to 2^32 - 1)", name)
    return tuple(value)
