"""Folding the Redis password into the URL, and keeping it out of logs."""

from __future__ import annotations

import pytest

from contract.redis_url import redact, with_password


def test_with_password() -> None:
    assert with_password("redis://10.0.0.1:6379/0", "") == "redis://10.0.0.1:6379/0"
    assert (
        with_password("redis://10.0.0.1:6379/0", "s3cr@t/")
        == "redis://:s3cr%40t%2F@10.0.0.1:6379/0"
    )
    assert with_password("rediss://u@h:1/2", "p") == "rediss://u:p@h:1/2"
    assert with_password("redis://[::1]:6379", "p") == "redis://:p@[::1]:6379"
    with pytest.raises(ValueError, match="redis-url"):
        with_password("unix:///tmp/r.sock", "p")


def test_redact() -> None:
    assert redact("redis://:hunter2@h:6379/0") == "redis://:***@h:6379/0"
    assert redact("rediss://u:p@h:1/2") == "rediss://u:***@h:1/2"
    assert redact("redis://h:6379/0") == "redis://h:6379/0"
    assert "hunter2" not in redact(with_password("redis://h:6379/0", "hunter2"))


async def test_password_from_url_authenticates() -> None:
    import redis.asyncio as aioredis

    from tests.support import RedisProcess

    proc = RedisProcess(password="pw-123").start()
    try:
        url = with_password(f"redis://127.0.0.1:{proc.port}/0", "pw-123")
        client = aioredis.from_url(url)
        assert await client.ping()
        await client.aclose()
    finally:
        proc.close()
