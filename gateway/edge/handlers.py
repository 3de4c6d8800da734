"""The OpenAI endpoints: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

The two generation endpoints are ``gateway.request_path.serve``; this module
only names them for the router table and answers ``/v1/models``.
"""

from __future__ import annotations

from aiohttp import web

from gateway.edge.app_keys import STATE
from gateway.request_path import serve


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await serve(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await serve(request, chat=False)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": state.config.model_name,
                    "object": "model",
                    "created": state.started_at,
                    "owned_by": "kvroute",
                    "max_model_len": state.dispatcher.max_model_len(state.tokenizer.max_model_len),
                }
            ],
        }
    )
