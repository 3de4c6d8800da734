"""What aiohttp alone costs: an OpenAI-shaped server on uvloop that routes nothing.

``bench_overhead --routers aiohttp_floor`` runs it beside the routers. It takes
a chat or completion request, parses its JSON (orjson) and answers at once with
``max_tokens`` words, as one JSON body or as one SSE event a token, with no
tokenizer, index, upstream or metrics. kvroute's gateway is this plus its
routing, so the gap between the two is the part of a request kvroute's own code
decides, and this server's figure (its CPU a request, its latency at c=1) is a
floor for any router built on aiohttp on this host.

With ``--forward URL,...`` (``bench_overhead --routers aiohttp_proxy``) it is
instead a round-robin proxy, what sglang-router and vllm-router are in their
``round_robin`` policy: the request's bytes go to the next worker's same path
over kvroute's own HTTP/1.1 client (``gateway.upstream.http1``), and the
response's bytes come back as they arrive, nothing parsed. That is the floor
under a router in Python: one more hop, no routing.
"""

from __future__ import annotations

import argparse
import itertools
import time

import orjson
import uvloop
from aiohttp import web

from gateway.upstream.http1 import Pool, Target

_JSON = {"Content-Type": "application/json"}


def _answer(body: dict[str, object], chat: bool) -> tuple[bytes, list[bytes]]:
    raw = body.get("max_tokens")
    n = raw if isinstance(raw, int) and 0 < raw <= 4096 else 16
    created = int(time.time())
    kind = "chat.completion" if chat else "text_completion"
    usage = {"prompt_tokens": 0, "completion_tokens": n, "total_tokens": n}
    if not body.get("stream"):
        text = " a" * n
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": text}}
            if chat
            else {"index": 0, "text": text}
        )
        whole = {
            "id": "floor",
            "object": kind,
            "created": created,
            "model": body.get("model"),
            "choices": [{**choice, "finish_reason": "length"}],
            "usage": usage,
        }
        return orjson.dumps(whole), []
    events = []
    for k in range(n):
        delta = {"delta": {"content": " a"}} if chat else {"text": " a"}
        chunk = {
            "id": "floor",
            "object": kind + ".chunk" if chat else kind,
            "created": created,
            "model": body.get("model"),
            "choices": [{"index": 0, **delta, "finish_reason": "length" if k == n - 1 else None}],
        }
        events.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return b"", events


async def _serve(request: web.Request, chat: bool) -> web.StreamResponse:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        raise web.HTTPBadRequest(text="the body is not JSON") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="the body is not a JSON object")
    whole, events = _answer(body, chat)
    if not events:
        return web.Response(body=whole, content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for event in events:
        await resp.write(event)
    await resp.write_eof()
    return resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, chat=False)


class _Proxy:
    """Round robin over ``urls``: each request's bytes to the next worker, its
    response's bytes back as they arrive."""

    def __init__(self, urls: list[str]) -> None:
        self.pool = Pool(connect_timeout_s=2.0)
        self.targets = {
            path: [Target(u.rstrip("/") + path, _JSON) for u in urls]
            for path in ("/v1/chat/completions", "/v1/completions")
        }
        self.turn = itertools.count()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        targets = self.targets[request.path]
        target = targets[next(self.turn) % len(targets)]
        body = await request.read()
        conn = self.pool.take(target.key) or await self.pool.connect(target)
        conn.begin(target.request(body))
        status = await conn.head()
        # Not parsed, as a proxy does not: the answer's shape is read off the bytes.
        stream = b'"stream":true' in body.replace(b" ", b"")
        if not stream or status != 200:
            data = await conn.whole_body(1 << 26)
            self.pool.release(conn)
            return web.Response(status=status, body=data, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        while data := await conn.read():
            await resp.write(data)
        self.pool.release(conn)
        await resp.write_eof()
        return resp


def app(forward: list[str] | None = None) -> web.Application:
    application = web.Application()
    if forward:
        proxy = _Proxy(forward)
        application.router.add_post("/v1/chat/completions", proxy.handle)
        application.router.add_post("/v1/completions", proxy.handle)
    else:
        application.router.add_post("/v1/chat/completions", chat_completions)
        application.router.add_post("/v1/completions", completions)
    return application


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.aiohttp_floor")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--forward", default="", help="worker URLs, comma-separated: a proxy")
    args = parser.parse_args(argv)
    forward = [u for u in args.forward.split(",") if u]
    loop = uvloop.new_event_loop()  # as kvroute's gateway runs
    web.run_app(
        app(forward), host=args.host, port=args.port, access_log=None, print=None, loop=loop
    )


if __name__ == "__main__":
    main()
