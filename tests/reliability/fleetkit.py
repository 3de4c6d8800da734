"""Helpers the reliability tests share: HTTP calls, SSE streams, worker block gauges.

Everything talks to real processes over loopback HTTP: the gateway started by
``loadtest.fleet.Fleet`` and the workers' own HTTP fronts (``/metrics``,
``/get_load``). Nothing here mocks a component.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loadtest.fleet import Fleet, FleetConfig
from tests.support import wait_until

# Heartbeats every 0.5 s with a 2 s TTL: a stopped or dead worker leaves the fleet in seconds.
HEARTBEAT_TTL = 2.0


def fault_fleet_config(
    model: Any, redis_url: str, namespace: str, workers: int, log_dir: str
) -> FleetConfig:
    """The small, fast-heartbeat fleet the fault tests (Redis trouble, killed workers) run."""
    return FleetConfig(
        model=str(model),
        workers=workers,
        redis_url=redis_url,
        namespace=namespace,
        num_blocks=512,
        max_num_seqs=4,
        heartbeat_interval=0.5,
        heartbeat_ttl=HEARTBEAT_TTL,
        log_dir=log_dir,
        gateway_args=("--log-level", "warning"),
    )


_BLOCKS = re.compile(r'^kvroute_worker_blocks\{[^}]*state="(\w+)"[^}]*\}\s+(\S+)$', re.M)
_BLOCK_GAUGES = {
    key: re.compile(rf"^kvroute_worker_{name}\{{[^}}]*\}}\s+(\S+)$", re.M)
    for key, name in (
        ("cached", "cached_blocks"),
        ("pinned", "pinned_blocks"),
        ("capacity", "block_capacity"),
    )
}
_FINISH = re.compile(
    r'^kvroute_worker_requests_total\{[^}]*finish_reason="(\w+)"[^}]*\}\s+(\S+)$', re.M
)


@dataclass
class Reply:
    """One plain HTTP exchange."""

    status: int
    headers: dict[str, str]
    body: Any


def call(
    url: str,
    body: Any = None,
    *,
    method: str | None = None,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
    timeout: float = 30.0,
) -> Reply:
    """``method url`` with a JSON (or raw) body; 4xx/5xx come back as a Reply, not raised."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(
        url,
        data=data,
        method=method or ("GET" if data is None else "POST"),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, hdrs, payload = resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        status, hdrs, payload = exc.code, dict(exc.headers), exc.read()
    try:
        parsed: Any = json.loads(payload)
    except ValueError:
        parsed = payload.decode(errors="replace")
    return Reply(status, {k.lower(): v for k, v in hdrs.items()}, parsed)


def is_openai_error(body: Any) -> bool:
    """True when ``body`` is ``{"error": {"message": str, "type": str, ...}}``."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return False
    err = body["error"]
    return isinstance(err.get("message"), str) and isinstance(err.get("type"), str)


def model_name(fleet: Fleet) -> str:
    return str(call(fleet.gateway_url + "/v1/models").body["data"][0]["id"])


def worker_metrics_text(http_url: str) -> str:
    with urllib.request.urlopen(http_url + "/metrics", timeout=10) as resp:
        return resp.read().decode()


def worker_blocks(http_url: str) -> dict[str, int]:
    """Block counts from /metrics: ``kvroute_worker_blocks{state}`` (used, free) plus the
    ``cached``, ``pinned`` and ``capacity`` gauges."""
    text = worker_metrics_text(http_url)
    blocks = {state: int(float(v)) for state, v in _BLOCKS.findall(text)}
    for key, rx in _BLOCK_GAUGES.items():
        match = rx.search(text)
        if match:
            blocks[key] = int(float(match.group(1)))
    return blocks


def worker_finishes(http_url: str) -> dict[str, int]:
    """``kvroute_worker_requests_total`` by finish_reason."""
    text = worker_metrics_text(http_url)
    return {reason: int(float(v)) for reason, v in _FINISH.findall(text)}


def worker_load(http_url: str) -> dict[str, int]:
    return dict(call(http_url + "/get_load").body)


_FIRST_TOKENS = re.compile(
    r'^kvroute_gateway_ttft_seconds_count\{[^}]*worker_id="([^"]+)"[^}]*\}\s+([0-9.eE+-]+)$',
    re.M,
)


def first_tokens_relayed(gateway_url: str) -> dict[str, int]:
    """Per worker, the streams whose first token the gateway has relayed (its TTFT count)."""
    text = worker_metrics_text(gateway_url)
    return {wid: int(float(v)) for wid, v in _FIRST_TOKENS.findall(text)}


def dashboard(gateway_url: str) -> dict[str, dict[str, Any]]:
    """The gateway's mirror as its dashboard reports it: worker id -> row."""
    data = call(gateway_url + "/dashboard/data").body
    return {row["worker_id"]: row for row in data["workers"]}


def all_blocks_free(fleet: Fleet) -> bool:
    """Every live worker's used blocks are back to its pinned ones (no leaked references)."""
    for w in fleet.workers:
        if w.proc.poll() is not None:
            continue
        blocks = worker_blocks(w.http_url)
        if blocks["used"] != blocks["pinned"]:
            return False
    return True


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.05) -> Any:
    """``tests.support.wait_until`` with the timeout and what-for always given, in that order."""
    return wait_until(predicate, timeout=timeout, interval=interval, what=what)


@dataclass
class StreamResult:
    """What a client saw of one streaming request."""

    status: int = 0
    worker: str = ""
    text: str = ""
    chunks: int = 0
    finish: str | None = None
    error: dict[str, Any] | None = None  # an error event inside the stream, or the error body
    done: bool = False  # saw ``data: [DONE]``
    events: list[Any] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error is None and self.finish is not None


async def stream(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    *,
    headers: dict[str, str] | None = None,
    started: asyncio.Event | None = None,
    stop_after_chunks: int | None = None,
) -> StreamResult:
    """POSTs a streaming request and reads its SSE events to the end.

    ``started`` is set at the first content chunk; ``stop_after_chunks`` drops
    the connection after that many events (a client that goes away).
    """
    result = StreamResult()
    async with session.post(url, json={**body, "stream": True}, headers=headers) as resp:
        result.status = resp.status
        result.worker = resp.headers.get("x-kvroute-worker", "")
        if resp.status != 200:
            result.error = await resp.json(content_type=None)
            return result
        async for raw in resp.content:
            line = raw.strip()
            if line.startswith(b": x-kvroute-worker: "):
                # Retried after the headers went out: the gateway names the serving worker.
                result.worker = line.split(b": ", 2)[2].decode()
                continue
            if not line.startswith(b"data: "):
                continue
            payload = line[len(b"data: ") :]
            if payload == b"[DONE]":
                result.done = True
                break
            event = json.loads(payload)
            result.events.append(event)
            if "error" in event:
                result.error = event
                continue
            for choice in event.get("choices", []):
                delta = choice.get("delta", {}).get("content") or choice.get("text") or ""
                result.text += delta
                if choice.get("finish_reason"):
                    result.finish = choice["finish_reason"]
            result.chunks += 1
            if started is not None and result.chunks >= 2:
                started.set()
            if stop_after_chunks is not None and result.chunks >= stop_after_chunks:
                resp.close()
                return result
    return result
