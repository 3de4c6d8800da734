"""Hand-assembled ``CallFrames`` bytes parse as the message the generated code builds."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from contract import call_frames
from contract import worker_pb2 as pb

# From 1, as the mux numbers calls: proto3 leaves a zero call_id off the wire.
call_ids = st.integers(min_value=1, max_value=2**64 - 1)
requests = st.builds(
    lambda rid, ids, salt: pb.GenerateRequest(
        request_id=rid, prompt_token_ids=ids, cache_salt=salt
    ),
    st.text(max_size=20),
    st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=300),
    st.text(max_size=8),
)
frames = st.lists(st.tuples(call_ids, st.none() | requests), max_size=6)


@given(st.integers(min_value=0, max_value=2**64 - 1))
def test_varint_round_trips_through_protobuf(n: int) -> None:
    # A CallFrame holding only call_id is its tag and the varint.
    parsed = pb.CallFrame.FromString(b"\x08" + call_frames.varint(n))
    assert parsed.call_id == n
    if n:  # proto3 writes no zero
        assert call_frames.varint(n) == pb.CallFrame(call_id=n).SerializeToString()[1:]


@given(frames)
def test_call_frames_equal_the_generated_message(
    spec: list[tuple[int, pb.GenerateRequest | None]],
) -> None:
    expected = pb.CallFrames()
    parts = []
    for call_id, request in spec:
        if request is None:
            expected.frames.add(call_id=call_id, cancel=True)
            parts.append(call_frames.cancel_frame(call_id))
        else:
            expected.frames.add(call_id=call_id, request=request)
            parts.append(call_frames.start_frame(call_id, request.SerializeToString()))
    wire = call_frames.call_frames(parts)
    parsed = pb.CallFrames.FromString(wire)
    assert parsed == expected
    assert [f.WhichOneof("body") for f in parsed.frames] == [
        "cancel" if r is None else "request" for _, r in spec
    ]
    # Byte for byte too: the generated code serializes fields in the same order.
    assert wire == expected.SerializeToString()
