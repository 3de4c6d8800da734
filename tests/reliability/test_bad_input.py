"""Bad input at the gateway's HTTP edge: generated HTTP requests against the gateway's own
OpenAPI description (schemathesis) and property-based bodies (hypothesis), hostile text and
header bytes, and slow clients. Malformed gRPC straight to a worker is
``test_bad_grpc_input``.

The invariants: no 5xx from the gateway for anything a client sends, every error an
OpenAI-shaped JSON body, oversized bodies refused with 413 before they are parsed,
prompt + max_tokens past the context refused with 400, and the worker behind it still
serving at the end.

The worker runs with ``--max-model-len 96`` (``bad_input_kit``) so generated requests that
are valid stay cheap; the whole module sends about ``TOTAL_REQUESTS`` requests, sized so
it stays inside the suite's time budget on two cores.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
import requests
import schemathesis
from hypothesis import given, settings

from contract import worker_pb2_grpc
from loadtest.fleet import Fleet
from tests.reliability.bad_input_kit import (
    CLIENT_TIMEOUT_S,
    FAST,
    MAX_BODY,
    MAX_MODEL_LEN,
    fleet_config,
    generate,
    worker_stub,
)
from tests.reliability.fleetkit import call, is_openai_error, model_name

pytestmark = pytest.mark.slow

# Measured on 2 busy cores: schemathesis ~25-60 requests/s (case generation dominates; valid
# chats that generate tokens ~10/s), the hypothesis bodies ~130/s: the module sends its
# 10,000 requests in about 2 minutes, most of them from the hypothesis bodies.
TOTAL_REQUESTS = 10_000  # including HOSTILE_EXAMPLES
SCHEMA_EXAMPLES = {"positive": 120, "negative": 400}  # per POST operation
BODY_EXAMPLES = 4_600  # per endpoint for the hypothesis bodies below
_RESPONSES = re.compile(r'^kvroute_gateway_responses_total\{code="(\d+)"\}\s+(\S+)$', re.M)


@pytest.fixture(scope="module")
def fleet(
    tiny_llama: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    log_dir = str(tmp_path_factory.mktemp("bad-input-logs"))
    with Fleet(fleet_config(tiny_llama, redis_url, "kvbadinput", log_dir)) as f:
        yield f


@pytest.fixture(scope="module")
def http() -> Iterator[requests.Session]:
    with requests.Session() as session:
        # A new connection per request: the gateway closes idle keep-alive connections
        # after --client-idle-timeout (2 s here), and a pooled one reused just as it is
        # closed ends in RemoteDisconnected with no response (a flake hypothesis could not
        # reproduce, on an input answered 400 before any worker).
        session.headers["Connection"] = "close"
        yield session


def check_response(resp: requests.Response | Any, what: object) -> None:
    """The gateway invariants for any response to anything a client may send."""
    assert resp.status_code < 500, (resp.status_code, resp.text[:300], what)
    if resp.status_code >= 400:
        assert is_openai_error(resp.json()), (resp.text[:300], what)


def _responses(fleet: Fleet) -> dict[int, float]:
    """``kvroute_gateway_responses_total`` by status code."""
    text = requests.get(fleet.gateway_url + "/metrics", timeout=10).text
    return {int(c): float(v) for c, v in _RESPONSES.findall(text)}


@pytest.fixture(scope="module")
def baseline(fleet: Fleet) -> dict[int, float]:
    """Responses before this module's requests (startup /readyz probes answer 503)."""
    return _responses(fleet)


# -- precise edges ---------------------------------------------------------------------------


def test_oversized_body_is_refused_before_parsing(fleet: Fleet, baseline: dict[int, float]) -> None:
    # Not JSON at all: a 413 (not a 400 invalid_json) shows the size check came first.
    raw = b"{" + b"x" * (2 * MAX_BODY)
    for path in ("/v1/chat/completions", "/v1/completions"):
        reply = call(fleet.gateway_url + path, raw=raw)
        assert reply.status == 413, reply.body
        assert is_openai_error(reply.body)
    chunked = requests.post(
        fleet.gateway_url + "/v1/completions",
        data=iter([b"{" + b"y" * 4096] * (MAX_BODY // 4096 + 2)),  # no Content-Length
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert chunked.status_code == 413 and is_openai_error(chunked.json())


def test_context_window_is_enforced(fleet: Fleet) -> None:
    model = model_name(fleet)
    url = fleet.gateway_url + "/v1/completions"
    short = call(url, {"model": model, "prompt": [1, 2, 3], "max_tokens": MAX_MODEL_LEN - 3})
    assert short.status == 200, short.body
    over = call(url, {"model": model, "prompt": [1, 2, 3], "max_tokens": MAX_MODEL_LEN - 2})
    assert over.status == 400 and over.body["error"]["code"] == "context_length_exceeded"
    long_prompt = call(url, {"model": model, "prompt": [5] * (MAX_MODEL_LEN + 1), "max_tokens": 1})
    assert long_prompt.status == 400 and is_openai_error(long_prompt.body)
    chat = call(
        fleet.gateway_url + "/v1/chat/completions",
        {"model": model, "messages": [{"role": "user", "content": "word " * 200}]},
    )
    assert chat.status == 400 and chat.body["error"]["param"] == "messages"


def test_out_of_range_sampling_values_are_400(fleet: Fleet, http: requests.Session) -> None:
    """Values that parse as JSON numbers but cannot travel in the worker's protobuf fields."""
    model = model_name(fleet)
    base = {"model": model, "prompt": [1, 2, 3], "max_tokens": 2}
    for extra in ({"top_k": 2**40}, {"top_k": 2**32}, {"temperature": 1e-40}, {"seed": 2**70}):
        resp = http.post(fleet.gateway_url + "/v1/completions", json=base | extra, timeout=30)
        check_response(resp, extra)


# -- schemathesis: every operation of /openapi.json -------------------------------------------


def test_schemathesis_generated_requests(fleet: Fleet, http: requests.Session) -> None:
    schema = schemathesis.openapi.from_url(fleet.gateway_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/chat/completions", "POST /v1/completions"}
    sent = 0
    for operation in operations:
        # GETs take no input: one positive case each; negative generation has nothing to break.
        modes = SCHEMA_EXAMPLES if operation.method.upper() == "POST" else {"positive": 1}
        for mode, examples in modes.items():
            strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))

            @settings(FAST, max_examples=examples)
            @given(case=strategy)
            def check(case: schemathesis.Case) -> None:
                nonlocal sent
                resp = case.call(base_url=fleet.gateway_url, session=http, timeout=30)
                sent += 1
                check_response(resp, (case.method, case.path, case.body, case.headers))

            check()
    assert sent >= sum(SCHEMA_EXAMPLES.values())


# -- hypothesis: bodies near the valid ones ---------------------------------------------------

_SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
)
_JSON = st.recursive(
    _SCALAR,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_FIELDS = [
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
    "n", "stop", "stream", "stream_options", "user", "ignore_eos", "prompt", "messages",
]  # fmt: skip


def _mutations() -> st.SearchStrategy[dict[str, Any]]:
    """Some known fields set to arbitrary JSON, others to plausible values."""
    plausible = {
        "max_tokens": st.integers(min_value=-5, max_value=200),
        "temperature": st.floats(min_value=-1, max_value=3),
        "top_p": st.floats(min_value=-0.5, max_value=1.5),
        "top_k": st.integers(min_value=-3, max_value=2**33),
        "stream": st.booleans(),
        "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=6)),
        "prompt": st.one_of(
            st.text(max_size=60), st.lists(st.integers(min_value=-2, max_value=2**33), max_size=30)
        ),
        "messages": st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "system", "assistant", "tool", ""]),
                    "content": _JSON,
                }
            ),
            max_size=3,
        ),
    }
    return st.dictionaries(
        st.sampled_from(_FIELDS),
        st.one_of(_JSON, *plausible.values()),
        max_size=6,
    )


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_hypothesis_bodies(fleet: Fleet, http: requests.Session, path: str) -> None:
    model = model_name(fleet)
    base: dict[str, Any] = {"model": model, "max_tokens": 4}
    base |= (
        {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    )

    @settings(FAST, max_examples=BODY_EXAMPLES)
    @given(changes=_mutations(), whole=st.booleans(), junk=_JSON)
    def check(changes: dict[str, Any], whole: bool, junk: Any) -> None:
        body: Any = junk if not whole and not changes else base | changes
        resp = http.post(fleet.gateway_url + path, data=json.dumps(body), timeout=30,
                         headers={"Content-Type": "application/json"})  # fmt: skip
        check_response(resp, body)
        if resp.status_code == 200 and body.get("stream") is True:
            assert resp.text.rstrip().endswith("data: [DONE]")

    check()


# -- hostile text, nesting and header bytes ---------------------------------------------------

# Lone UTF-16 surrogates (JSON escapes them as \ud800), control characters, bidi and BOM.
_HOSTILE_CHARS = ["\ud800", "\udfff", "\udc80", "\x00", "\x07", "\x1b", "\x7f", "\u202e", "\ufeff"]
_HOSTILE_TEXT = st.lists(
    st.one_of(st.sampled_from(_HOSTILE_CHARS), st.text(max_size=4)), min_size=1, max_size=12
).map("".join)
# Octets HTTP allows in a header value (visible ASCII and obs-text 0x80-0xff), mostly
# not UTF-8; control bytes are refused by the HTTP parser itself, before the app.
_HEADER_BYTES = st.lists(
    st.one_of(st.integers(0x21, 0x7E), st.integers(0x80, 0xFF)), min_size=1, max_size=24
).map(bytes)
HOSTILE_EXAMPLES = 300


def _nested(depth: int, kind: str) -> bytes:
    return (
        (b"[" * depth + b"]" * depth)
        if kind == "list"
        else (b'{"a":' * depth + b"1" + b"}" * depth)
    )


@settings(FAST, max_examples=HOSTILE_EXAMPLES)
@given(
    text=_HOSTILE_TEXT,
    where=st.sampled_from(["content", "prompt", "stop", "user", "role"]),
    depth=st.sampled_from([0, 0, 100, 5_000, 100_000]),
    kind=st.sampled_from(["list", "dict"]),
    header=st.one_of(st.none(), _HEADER_BYTES),
    header_name=st.sampled_from(["Authorization", "X-Session-ID"]),
)
def test_hostile_text_nesting_and_header_bytes(
    fleet: Fleet,
    http: requests.Session,
    text: str,
    where: str,
    depth: int,
    kind: str,
    header: bytes | None,
    header_name: str,
) -> None:
    """Surrogates, control characters, JSON nested 5k-100k deep and non-UTF-8 header bytes:
    each answered 2xx or 4xx with an OpenAI error body, never 5xx."""
    model = model_name(fleet)
    chat = where in ("content", "role", "user")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": model, "max_tokens": 2}
    if chat:
        role = text if where == "role" else "user"
        body["messages"] = [{"role": role, "content": text if where == "content" else "hi"}]
    else:
        body["prompt"] = text if where == "prompt" else "hi"
    if where in ("stop", "user"):
        body[where] = text
    raw = _nested(depth, kind) if depth else json.dumps(body).encode()  # ensure_ascii escapes
    headers: dict[str, str | bytes] = {"Content-Type": "application/json"}
    if header is not None:
        headers[header_name] = (b"Bearer " if header_name == "Authorization" else b"") + header
    resp = http.post(fleet.gateway_url + path, data=raw, headers=headers, timeout=30)
    check_response(resp, (where, text, depth, kind, header))


# -- slow clients (slowloris) ------------------------------------------------------------------


def _closed_after(sock: socket.socket, trickle: bytes, gap_s: float) -> tuple[float, bytes]:
    """Sends ``trickle`` a byte per ``gap_s`` until the gateway answers or closes; returns
    the seconds that took and what came back."""
    started = time.monotonic()
    sock.settimeout(gap_s)
    for i in range(len(trickle) + 1):
        try:
            reply = sock.recv(4096)
            return time.monotonic() - started, reply  # b"" = closed
        except TimeoutError:
            pass
        if i < len(trickle):
            try:
                sock.send(trickle[i : i + 1])
            except OSError:  # closed under us
                return time.monotonic() - started, b""
    raise AssertionError("the gateway held a slow connection open")


@pytest.mark.parametrize("stage", ["silent", "headers", "body"])
def test_slow_clients_are_cut_off(fleet: Fleet, stage: str) -> None:
    """A connection that sends nothing, its headers a byte at a time, or its body a byte at
    a time is closed (or answered 408) soon after the client timeouts, not held."""
    host, port = "127.0.0.1", int(fleet.gateway_url.rsplit(":", 1)[1])
    body = b'{"model": "x", "prompt": "' + b"a" * 200 + b'"}'
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    with socket.create_connection((host, port)) as sock:
        if stage == "silent":
            took, reply = _closed_after(sock, b"", 6 * CLIENT_TIMEOUT_S)  # sends nothing
        elif stage == "headers":
            took, reply = _closed_after(sock, head, 0.3)
        else:
            sock.sendall(head)
            took, reply = _closed_after(sock, body, 0.3)
    assert took < 3 * CLIENT_TIMEOUT_S, took
    if stage == "body":
        assert reply.startswith(b"HTTP/1.1 408"), reply[:80]
    else:
        assert reply == b"", reply[:80]


@pytest.fixture(scope="module")
def stub(fleet: Fleet) -> Iterator[worker_pb2_grpc.WorkerStub]:
    with worker_stub(fleet) as s:
        yield s


def test_total_requests_and_engine_alive(
    fleet: Fleet, baseline: dict[int, float], stub: worker_pb2_grpc.WorkerStub
) -> None:
    """Runs last: the module really sent its share of generated requests, the gateway never
    answered 5xx, and the worker still serves."""
    now = _responses(fleet)
    sent = {c: v - baseline.get(c, 0.0) for c, v in now.items() if v > baseline.get(c, 0.0)}
    assert not {c: v for c, v in sent.items() if c >= 500}, sent
    assert sum(sent.values()) >= TOTAL_REQUESTS, sent
    assert generate(stub, [4, 5, 6], max_tokens=2) == "OK"
