"""``CallFrames`` written straight to protobuf's wire format, around serialized requests.

Building the message the usual way copies each request twice: a
``GenerateRequest`` set as a ``CallFrame``'s field is copied into it, and the
frame again into the ``CallFrames`` that batches it (upb copies sub-messages
on assignment). For a 6k-token prompt those two copies cost ~150 us, more
than serializing it (~40 us). The gateway serializes each request once and
puts the bytes here; the result parses as the same ``CallFrames`` message
(``tests/contract/test_call_frames.py`` checks it against the generated code).

Field numbers are ``proto/worker.proto``'s::

    message CallFrame { uint64 call_id = 1; oneof body { GenerateRequest request = 2; bool cancel = 3; } }
    message CallFrames { repeated CallFrame frames = 1; }
"""

from __future__ import annotations

from collections.abc import Iterable

# Each tag is (field number << 3) | wire type: 0 for a varint, 2 for a length-delimited field.
_CALL_ID = b"\x08"  # CallFrame.call_id = 1, varint
_REQUEST = b"\x12"  # CallFrame.request = 2, length-delimited
_CANCEL = b"\x18\x01"  # CallFrame.cancel = 3, varint true
_FRAME = b"\x0a"  # CallFrames.frames = 1, length-delimited


def varint(n: int) -> bytes:
    """``n`` (non-negative) as a protobuf base-128 varint."""
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def start_frame(call_id: int, request: bytes) -> bytes:
    """A serialized ``CallFrame`` starting call ``call_id`` with the serialized ``request``."""
    return _CALL_ID + varint(call_id) + _REQUEST + varint(len(request)) + request


def cancel_frame(call_id: int) -> bytes:
    """A serialized ``CallFrame`` cancelling call ``call_id``."""
    return _CALL_ID + varint(call_id) + _CANCEL


def call_frames(frames: Iterable[bytes]) -> bytes:
    """A serialized ``CallFrames`` holding the serialized ``frames``, in order."""
    parts: list[bytes] = []
    for frame in frames:
        parts += (_FRAME, varint(len(frame)), frame)
    return b"".join(parts)
