"""What aiohttp's server logger may say about a request its HTTP parser refused.

aiohttp logs a request it cannot parse at ERROR with the exception, and the
exception quotes the request: an over-long header's first 100 bytes
(``LineTooLong``), or the raw bytes around a bad character. That can be an
``Authorization: Bearer`` key. ``RedactParserErrors`` rewrites such a record
to the client address, the error class and the status, at WARNING (a client's
mistake, not the gateway's), and drops the traceback; other records pass
untouched.
"""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError

SERVER_LOGGER = "aiohttp.server"


class RedactParserErrors(logging.Filter):
    """Keeps request bytes out of log records about requests the parser refused."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        # record.args is ("Error handling request from %s", remote)'s remote.
        remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        record.msg = "refused an unparsable request from %s: %s (status %s; bytes not logged)"
        record.args = (remote, type(exc).__name__, exc.code)
        record.exc_info = None
        record.exc_text = None
        if record.levelno > logging.WARNING:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def redact_parser_errors(logger: logging.Logger | None = None) -> RedactParserErrors:
    """Installs the filter on aiohttp's server logger (once); returns it."""
    target = logger or logging.getLogger(SERVER_LOGGER)
    for existing in target.filters:
        if isinstance(existing, RedactParserErrors):
            return existing
    installed = RedactParserErrors()
    target.addFilter(installed)
    return installed
