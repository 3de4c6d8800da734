"""How a ``GenerateRequest`` carries its prompt's token ids.

Two encodings of the same ids: packed varints (``prompt_token_ids``, what every
worker reads) and little-endian uint32 bytes (``prompt_token_ids_le32``). For
a 6,000-token prompt the varints cost the gateway 166 µs to build and
serialize and the worker 190 µs to read back into a list; the bytes 35 and 80
µs. A worker that reads the bytes says so in its registry record
(``prompt_encoding``), so a gateway never sends them to one that does not.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any

PROMPT_LE32 = "le32"  # the registry record's prompt_encoding for workers that read the bytes

if array("I").itemsize != 4:  # C's unsigned int: 4 bytes on every platform CPython runs on
    raise ImportError("contract.prompt_wire needs a 4-byte array('I')")


def le32(token_ids: Sequence[int]) -> bytes:
    """The ids as little-endian uint32s; ``OverflowError`` for one outside [0, 2**32)."""
    packed = array("I", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def prompt_length(request: Any) -> int:
    """How many ids a ``GenerateRequest``'s prompt has, without decoding them."""
    return len(request.prompt_token_ids_le32) // 4 or len(request.prompt_token_ids)


def prompt_ids(request: Any) -> list[int]:
    """A ``GenerateRequest``'s prompt, whichever encoding it came in.

    ``ValueError`` when both are set or the bytes are not whole uint32s.
    """
    raw = request.prompt_token_ids_le32
    if not raw:
        return list(request.prompt_token_ids)
    if request.prompt_token_ids:
        raise ValueError("set prompt_token_ids or prompt_token_ids_le32, not both")
    if len(raw) % 4:
        raise ValueError(f"prompt_token_ids_le32 has {len(raw)} bytes, not a multiple of 4")
    ids = array("I")
    ids.frombytes(raw)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tolist()
