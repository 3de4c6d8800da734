"""The OpenAI endpoints: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``
and ``/v1/models/{model}``.

The two generation endpoints are ``gateway.request_path.serve``; this module
only names them for the router table and answers the model list and cards.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.edge.app_keys import STATE
from gateway.request_path import check_model, serve


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await serve(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await serve(request, chat=False)


def _model_card(request: web.Request, name: str) -> dict[str, Any]:
    state = request.app[STATE]
    return {
        "id": name,
        "object": "model",
        "created": state.started_at,
        "owned_by": "kvroute",
        "root": state.config.model_name,
        "max_model_len": state.dispatcher.max_model_len(state.tokenizer.max_model_len),
    }


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models``: one card per served name (aliases included)."""
    names = request.app[STATE].config.model_names
    return web.json_response({"object": "list", "data": [_model_card(request, n) for n in names]})


async def model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}`` (the SDK's ``models.retrieve``); 404 for an unknown name."""
    name = request.match_info["model"]
    check_model(request.app[STATE], name)
    return web.json_response(_model_card(request, name))
