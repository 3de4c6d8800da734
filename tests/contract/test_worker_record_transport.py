"""Registry records of openai-http workers, old records, and the tokenizer fingerprint."""

from __future__ import annotations

import pytest

from contract.redis_layout import TRANSPORT_GRPC, TRANSPORT_OPENAI_HTTP, WorkerRecord
from contract.tokenizer_probe import PROBE_MESSAGES, fingerprint, probe_ids


def test_an_openai_http_record_round_trips() -> None:
    rec = WorkerRecord(
        worker_id="vllm-0",
        address="http://10.0.0.5:8000",
        transport=TRANSPORT_OPENAI_HTTP,
        http_url="http://10.0.0.5:8000",
        tokenizer_fingerprint="tok1:0123456789abcdef",
        block_size=32,
    )
    assert WorkerRecord.from_mapping(rec.to_mapping()) == rec


def test_a_record_written_before_the_new_fields_decodes_as_grpc() -> None:
    old = {
        b"worker_id": b"w0",
        b"address": b"127.0.0.1:50051",
        b"model": b"m",
        b"hash_spec": b'{"block_size": 16}',
        b"block_size": b"16",
        b"running": b"2",
    }
    rec = WorkerRecord.from_mapping(old)
    assert rec.transport == TRANSPORT_GRPC
    assert rec.http_url == "" and rec.tokenizer_fingerprint == ""
    assert rec.running == 2


def test_an_unknown_transport_is_malformed() -> None:
    raw = WorkerRecord(worker_id="w", address="x").to_mapping()
    raw["transport"] = "carrier-pigeon"
    with pytest.raises(ValueError, match="transport"):
        WorkerRecord.from_mapping(raw)


class _FakeTokenizer:
    """Just enough of a Hugging Face tokenizer: a template and a character-level vocab."""

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):  # type: ignore[no-untyped-def]
        assert add_generation_prompt and not tokenize
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        assert not add_special_tokens
        return [ord(c) + self.offset for c in text]


def test_fingerprint_is_stable_and_tells_tokenizers_apart() -> None:
    chat, text = probe_ids(_FakeTokenizer())
    assert chat[:8] == [ord(c) for c in "<system>"]
    assert PROBE_MESSAGES[0]["role"] == "system"
    fp = fingerprint(chat, text)
    assert fp == fingerprint(*probe_ids(_FakeTokenizer()))
    assert fp.startswith("tok1:") and len(fp) == len("tok1:") + 16
    assert fp != fingerprint(*probe_ids(_FakeTokenizer(offset=1)))
    assert fingerprint([1, 2], [3]) != fingerprint([1], [2, 3])


class _NoTemplate(_FakeTokenizer):
    def apply_chat_template(self, messages, add_generation_prompt, tokenize):  # type: ignore[no-untyped-def]
        raise ValueError("no chat template")


def test_a_tokenizer_without_a_chat_template_fingerprints_its_text_only() -> None:
    chat, text = probe_ids(_NoTemplate())
    assert chat == [] and text
    assert fingerprint(chat, text) != fingerprint(*probe_ids(_FakeTokenizer()))
