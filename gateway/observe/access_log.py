"""One access log line per HTTP request, at INFO on the ``kvroute.access`` logger.

The request path notes what it learns on a ``web.Request`` (``note_request``:
request id, tenant and the prompt's tokenizing time; ``observe_finished``:
worker, routing reason, prompt, predicted and reported cached tokens, generated
tokens, TTFT); the error middleware writes the line once the response is done,
whatever its status::

    POST /v1/chat/completions 200 id=chatcmpl-1f.. tenant=- worker=worker-0 reason=cache
      prompt=161 predicted=144 cached=144 completion=48 tokenize=0.0009s ttft=0.113s
      time=0.742s

(one line in the log). Probes and scrapes (``/health``, ``/readyz``, ``/metrics``,
the dashboard's polls) log at DEBUG. ``--access-log false`` turns it off.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from gateway.observe.metrics import GatewayMetrics
    from gateway.routing.jobs import Stream

access_logger = logging.getLogger("kvroute.access")
QUIET_PATHS = frozenset({"/health", "/healthz", "/readyz", "/metrics", "/dashboard/data"})


@dataclass
class AccessRecord:
    """What one request's log line says beyond method, path and status."""

    request_id: str = "-"
    tenant: str = "-"
    worker_id: str = "-"
    reason: str = "-"
    prompt_tokens: int | None = None
    predicted_cached_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    tokenize_s: float | None = None
    ttft_s: float | None = None


ACCESS = web.RequestKey("access", AccessRecord)


def note_request(
    request: web.Request, request_id: str, tenant: str, tokenize_s: float
) -> AccessRecord:
    """Starts the record of an OpenAI request (called once its id is known)."""
    record = AccessRecord(request_id=request_id, tenant=tenant or "-", tokenize_s=tokenize_s)
    request[ACCESS] = record
    return record


def observe_finished(
    request: web.Request,
    metrics: GatewayMetrics,
    stream: Stream,
    completion_tokens: int,
    cached_tokens: int | None,
) -> None:
    """A generation ended: counts its tokens and completes its access record."""
    metrics.worker(stream.worker_id).generation_tokens.inc(completion_tokens)
    record = request.get(ACCESS)
    if record is None:
        return
    record.worker_id = stream.worker_id
    record.reason = stream.reason
    record.prompt_tokens = len(stream.job.prompt_ids)
    record.predicted_cached_tokens = stream.predicted_cached_tokens
    record.cached_tokens = cached_tokens
    record.completion_tokens = completion_tokens
    first_at = getattr(stream, "first_at", None)
    if first_at is not None:
        record.ttft_s = first_at - stream.job.started


def _n(value: int | None) -> str:
    return "-" if value is None else str(value)


def log_access(request: web.Request, status: int, started: float) -> None:
    """Writes the line for a finished request (``started``: its ``perf_counter()``)."""
    level = logging.DEBUG if request.path in QUIET_PATHS else logging.INFO
    if not access_logger.isEnabledFor(level):
        return
    r = request.get(ACCESS) or AccessRecord()
    ttft = "-" if r.ttft_s is None else f"{r.ttft_s:.3f}s"
    tokenize = "-" if r.tokenize_s is None else f"{r.tokenize_s:.4f}s"
    access_logger.log(
        level,
        "%s %s %d id=%s tenant=%s worker=%s reason=%s prompt=%s predicted=%s cached=%s "
        "completion=%s tokenize=%s ttft=%s time=%.3fs",
        request.method,
        request.path,
        status,
        r.request_id,
        r.tenant,
        r.worker_id,
        r.reason,
        _n(r.prompt_tokens),
        _n(r.predicted_cached_tokens),
        _n(r.cached_tokens),
        _n(r.completion_tokens),
        tokenize,
        ttft,
        time.perf_counter() - started,
    )
