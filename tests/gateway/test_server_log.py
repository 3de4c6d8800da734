"""aiohttp's server logger, filtered: a refused request's bytes never reach a log line."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp import web

from openai_api.server_log import SERVER_LOGGER, RedactParserErrors, redact_parser_errors

SECRET = b"sk-secret-4f2a9b7c1d3e"


async def _send(head: bytes) -> bytes:
    runner = web.AppRunner(web.Application())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n\r\n")
        await writer.drain()
        reply = await reader.read()
        writer.close()
        return reply
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    "head",
    [
        b"Authorization: Bearer " + SECRET + b"x" * 9000,
        b"Authorization: Bearer " + SECRET + b"\x01",
    ],
    ids=["over-long", "bad-byte"],
)
async def test_parser_errors_name_the_error_not_the_bytes(
    head: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    logger = logging.getLogger(SERVER_LOGGER)
    installed = redact_parser_errors()
    try:
        assert redact_parser_errors() is installed  # installed once
        with caplog.at_level(logging.DEBUG, logger=SERVER_LOGGER):
            reply = await _send(head)
        assert reply.startswith(b"HTTP/1.0 400 ")
        [record] = [r for r in caplog.records if r.name == SERVER_LOGGER]
        assert record.levelno == logging.WARNING and record.exc_info is None
        assert record.getMessage().startswith("refused an unparsable request from 127.0.0.1: ")
        assert SECRET.decode() not in caplog.text
    finally:
        logger.removeFilter(installed)


async def test_without_the_filter_aiohttp_logs_the_header(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The reason for the filter: aiohttp quotes the header's first 100 bytes at ERROR."""
    assert not any(
        isinstance(f, RedactParserErrors) for f in logging.getLogger(SERVER_LOGGER).filters
    )
    with caplog.at_level(logging.DEBUG, logger=SERVER_LOGGER):
        await _send(b"Authorization: Bearer " + SECRET + b"x" * 9000)
    assert SECRET.decode() in caplog.text
    assert any(r.levelno == logging.ERROR for r in caplog.records)
