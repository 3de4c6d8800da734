"""The OpenAPI 3 description of the gateway's HTTP endpoints, served at ``/openapi.json``."""

from __future__ import annotations

from typing import Any

from gateway import __doc__ as _package_doc
from openai_api.options import UNSUPPORTED, options_for

_ERROR = {"$ref": "#/components/schemas/Error"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _errors(*codes: int) -> dict[str, Any]:
    text = {
        400: "Invalid request",
        401: "Missing or invalid API key",
        404: "Unknown model",
        413: "Body too large",
        429: "Every worker's queue is full (see Retry-After)",
        502: "A worker failed",
        503: "No healthy worker",
        504: "Timed out",
    }
    return {str(c): {"description": text[c], "content": _json(_ERROR)} for c in codes}


_SAMPLING: dict[str, Any] = {
    "model": {"type": "string"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2, "default": 1},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1, "default": 1},
    "seed": {"type": "integer"},
    "n": {"type": "integer", "minimum": 1, "maximum": 16, "default": 1},
    "top_k": {"type": "integer", "minimum": -1},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "ignore_eos": {"type": "boolean", "default": False},
    "cache_salt": {"type": "string"},
    "stop": {
        "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]
    },
    "stream": {"type": "boolean", "default": False},
    "stream_options": {
        "type": "object",
        "properties": {
            "include_usage": {"type": "boolean"},
            "continuous_usage_stats": {"type": "boolean"},
        },
    },
    "user": {"type": "string"},
}
_CHAT_ONLY: dict[str, Any] = {
    "chat_template_kwargs": {"type": "object"},
    "add_generation_prompt": {"type": "boolean", "default": True},
    "tools": {
        "type": "array",
        "maxItems": 128,
        "items": {
            "type": "object",
            "required": ["type", "function"],
            "properties": {
                "type": {"enum": ["function"]},
                "function": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                        "description": {"type": "string"},
                        "parameters": {"type": "object"},
                        "strict": {"type": "boolean"},
                    },
                },
            },
        },
    },
    "tool_choice": {
        "oneOf": [
            {"enum": ["none", "auto", "required"]},
            {
                "type": "object",
                "required": ["type", "function"],
                "properties": {
                    "type": {"enum": ["function"]},
                    "function": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {"name": {"type": "string"}},
                    },
                },
            },
        ]
    },
}


def _options(endpoint: str) -> dict[str, Any]:
    """Every option of ``endpoint`` from ``openai_api.options``, with its support status.

    ``x-kvroute-support`` is ``supported``, ``ignored`` (accepted, no effect) or
    ``unsupported`` (400 ``unsupported_parameter`` unless sent at its default).
    """
    props: dict[str, Any] = {}
    for name, (status, what) in options_for(endpoint).items():
        if name in ("model", "messages", "prompt"):
            continue
        schema = dict(_SAMPLING.get(name) or _CHAT_ONLY.get(name) or {})
        note = {"supported": "Supported", "ignored": "Accepted and ignored"}.get(
            status, "Unsupported: 400 unsupported_parameter unless sent at its default"
        )
        schema["description"] = f"{note}: {what}"
        schema["x-kvroute-support"] = status
        if status == UNSUPPORTED:
            schema["nullable"] = True
        props[name] = schema
    return props


_SESSION = {
    "name": "X-Session-ID",
    "in": "header",
    "required": False,
    "schema": {"type": "string"},
    "description": "Keeps a conversation on one worker (session affinity)",
}
_ROUTE_HEADERS = {
    "x-kvroute-worker": {"schema": {"type": "string"}, "description": "The worker that served"},
    "x-kvroute-reason": {
        "schema": {"type": "string", "enum": ["cache", "session", "load", "fallback", "retry"]},
        "description": "Why it was chosen",
    },
}


def _generation(summary: str, request_schema: str, response_schema: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "parameters": [_SESSION],
            "requestBody": {"required": True, "content": _json({"$ref": request_schema})},
            "responses": {
                "200": {
                    "description": "The completion (JSON), or server-sent events ending in "
                    "`data: [DONE]` when `stream` is true",
                    "headers": _ROUTE_HEADERS,
                    "content": {
                        **_json({"$ref": response_schema}),
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **_errors(400, 401, 404, 413, 429, 502, 503, 504),
            },
        }
    }


def openapi_spec(model_names: tuple[str, ...]) -> dict[str, Any]:
    """The spec, with the served model names filled in."""
    usage = {
        "type": "object",
        "properties": {
            "prompt_tokens": {"type": "integer"},
            "completion_tokens": {"type": "integer"},
            "total_tokens": {"type": "integer"},
            "prompt_tokens_details": {
                "type": "object",
                "properties": {"cached_tokens": {"type": "integer"}},
            },
        },
    }
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {
                "type": "string",
                "enum": ["system", "developer", "user", "assistant", "tool"],
            },
            "content": {
                "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]
            },
        },
    }
    simple = {"200": {"description": "OK", "content": _json({"type": "object"})}}
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "kvroute gateway",
            "version": "0.1.0",
            "description": (_package_doc or "").strip(),
        },
        "paths": {
            "/v1/chat/completions": _generation(
                "Chat completion",
                "#/components/schemas/ChatRequest",
                "#/components/schemas/ChatCompletion",
            ),
            "/v1/completions": _generation(
                "Text completion",
                "#/components/schemas/CompletionRequest",
                "#/components/schemas/Completion",
            ),
            "/v1/models": {
                "get": {
                    "summary": "The served model, once per served name",
                    "responses": {**simple, **_errors(401)},
                }
            },
            "/v1/models/{model}": {
                "get": {
                    "summary": "One served model (404 for an unknown name)",
                    "parameters": [
                        {
                            "name": "model",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string", "enum": list(model_names)},
                        }
                    ],
                    "responses": {**simple, **_errors(401, 404)},
                }
            },
            "/healthz": {"get": {"summary": "Liveness", "responses": simple}},
            "/readyz": {
                "get": {
                    "summary": "Readiness: Redis or a mirror, and a healthy worker",
                    "responses": {**simple, "503": {"description": "Not ready"}},
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {
                        "200": {
                            "description": "Text exposition format",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
            "/dashboard": {
                "get": {
                    "summary": "Live per-worker dashboard (HTML)",
                    "responses": {
                        "200": {
                            "description": "HTML",
                            "content": {"text/html": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
            "/dashboard/data": {"get": {"summary": "The dashboard's data", "responses": simple}},
            "/openapi.json": {"get": {"summary": "This document", "responses": simple}},
        },
        "components": {
            "schemas": {
                "Error": {
                    "type": "object",
                    "properties": {
                        "error": {
                            "type": "object",
                            "properties": {
                                "message": {"type": "string"},
                                "type": {"type": "string"},
                                "param": {"type": "string", "nullable": True},
                                "code": {"type": "string", "nullable": True},
                            },
                        }
                    },
                },
                "Usage": usage,
                "ChatRequest": {
                    "type": "object",
                    "required": ["model", "messages"],
                    "properties": {
                        **_options("chat"),
                        "model": {"type": "string", "enum": list(model_names)},
                        "messages": {"type": "array", "items": message, "minItems": 1},
                    },
                },
                "CompletionRequest": {
                    "type": "object",
                    "required": ["model", "prompt"],
                    "properties": {
                        **_options("completion"),
                        "model": {"type": "string", "enum": list(model_names)},
                        "prompt": {
                            "oneOf": [
                                {"type": "string"},
                                {"type": "array", "items": {"type": "integer"}},
                            ]
                        },
                    },
                },
                "ChatCompletion": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string"},
                        "object": {"type": "string"},
                        "created": {"type": "integer"},
                        "model": {"type": "string"},
                        "choices": {"type": "array", "items": {"type": "object"}},
                        "usage": {"$ref": "#/components/schemas/Usage"},
                    },
                },
                "Completion": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "string"},
                        "object": {"type": "string"},
                        "created": {"type": "integer"},
                        "model": {"type": "string"},
                        "choices": {"type": "array", "items": {"type": "object"}},
                        "usage": {"$ref": "#/components/schemas/Usage"},
                    },
                },
            }
        },
    }
