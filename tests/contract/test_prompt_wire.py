"""Both prompt encodings of a ``GenerateRequest`` read back as the same ids."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contract import prompt_wire
from contract import worker_pb2 as pb

token_lists = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=400)


@given(token_lists)
def test_both_encodings_survive_the_wire_as_the_same_ids(ids: list[int]) -> None:
    varint = pb.GenerateRequest(prompt_token_ids=ids).SerializeToString()
    le32 = pb.GenerateRequest(prompt_token_ids_le32=prompt_wire.le32(ids)).SerializeToString()
    assert prompt_wire.prompt_ids(pb.GenerateRequest.FromString(varint)) == ids
    assert prompt_wire.prompt_ids(pb.GenerateRequest.FromString(le32)) == ids
    for wire in (varint, le32):
        assert prompt_wire.prompt_length(pb.GenerateRequest.FromString(wire)) == len(ids)


def test_the_bytes_are_little_endian() -> None:
    assert prompt_wire.le32([1, 0x01020304]) == b"\x01\x00\x00\x00\x04\x03\x02\x01"


@pytest.mark.parametrize(
    ("request_", "needle"),
    [
        (pb.GenerateRequest(prompt_token_ids=[1], prompt_token_ids_le32=b"\x01\0\0\0"), "not both"),
        (pb.GenerateRequest(prompt_token_ids_le32=b"\x01\0\0"), "multiple of 4"),
    ],
)
def test_malformed_prompts_are_value_errors(request_: pb.GenerateRequest, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        prompt_wire.prompt_ids(request_)


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_ids_outside_uint32_cannot_be_encoded(bad: int) -> None:
    with pytest.raises(OverflowError):
        prompt_wire.le32([1, bad])
