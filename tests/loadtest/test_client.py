"""The load client against a fake OpenAI-compatible server on port 0 (unit test of one module)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web

from loadtest.client import ClientConfig, run_load, summarize_results
from loadtest.workloads import ChatConfig, Conversation, Turn, chat_workload


class FakeServer:
    """Streams ``WORDS`` chunks per request; cached tokens = 10 x the turn index."""

    WORDS = ["alpha", " beta", " gamma"]

    def __init__(self, fail_user: str | None = None) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.fail_user = fail_user

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.paths.append(request.path)
        session = request.headers.get("X-Session-ID", "")
        if session == self.fail_user:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        turn = sum(1 for m in body.get("messages", []) if m["role"] == "user") - 1
        resp = web.StreamResponse(
            headers={"x-kvroute-worker": f"w-{session}", "x-kvroute-reason": "cache"}
        )
        await resp.prepare(request)
        for word in self.WORDS:
            chunk = {"choices": [{"index": 0, "delta": {"content": word}}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {
            "prompt_tokens": 100,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 10 * max(turn, 0)},
        }
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp


async def serve(fake: FakeServer) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake.handle)
    app.router.add_post("/v1/completions", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def test_multi_turn_sends_the_real_answer_and_measures() -> None:
    fake = FakeServer()
    runner, url = await serve(fake)
    try:
        convs = chat_workload(
            ChatConfig(
                users=2,
                turns=3,
                system_tokens=20,
                question_tokens=5,
                answer_tokens=3,
                think_time_s=1.0,
                arrival_rate=50.0,
            )
        )
        results = await run_load(convs, ClientConfig(base_url=url, model="m", time_scale=0.01))
    finally:
        await runner.cleanup()
    assert len(results) == 6 and all(r.ok for r in results)
    third = [b for b in fake.bodies if len(b["messages"]) == 6]
    assert len(third) == 2
    assert third[0]["messages"][2] == {"role": "assistant", "content": "alpha beta gamma"}
    assert third[0]["stream"] is True and third[0]["max_tokens"] == 3
    for r in results:
        assert r.worker == f"w-{r.conv_id}" and r.headers["x-kvroute-reason"] == "cache"
        assert r.cached_tokens == 10 * r.turn and r.prompt_tokens == 100
        assert r.ttft_s is not None and r.e2e_s is not None and r.e2e_s >= r.ttft_s
        assert len(r.itl_s) == 2 and r.completion_tokens == 3
    summary = summarize_results(results)
    assert summary["hit_rate"] == pytest.approx(60 / 600)
    assert summary["turn_hit_rate"] == {0: 0.0, 1: 0.1, 2: 0.2}
    assert summary["load_cov"] == 0.0 and summary["errors"] == {}


async def test_errors_are_recorded_and_stop_that_conversation() -> None:
    fake = FakeServer(fail_user="user0001")
    runner, url = await serve(fake)
    try:
        convs = chat_workload(
            ChatConfig(
                users=2,
                turns=2,
                system_tokens=4,
                question_tokens=2,
                answer_tokens=3,
                think_time_s=0.0,
                arrival_rate=50.0,
            )
        )
        results = await run_load(convs, ClientConfig(base_url=url, model="m"))
    finally:
        await runner.cleanup()
    assert sorted((r.conv_id, r.turn, r.error) for r in results) == [
        ("user0000", 0, None),
        ("user0000", 1, None),
        ("user0001", 0, "http_500"),
    ]
    assert summarize_results(results)["errors"] == {"http_500": 1}


async def test_token_id_prompts_go_to_completions() -> None:
    fake = FakeServer()
    runner, url = await serve(fake)
    try:
        conv = Conversation("r0", 0.0, (), (Turn((), (), 4, prompt_ids=(5, 6, 7)),))
        (res,) = await run_load([conv], ClientConfig(base_url=url, model="m"))
    finally:
        await runner.cleanup()
    assert res.ok and fake.paths == ["/v1/completions"]
    assert fake.bodies[0]["prompt"] == [5, 6, 7] and "messages" not in fake.bodies[0]


def test_config_checks_the_url() -> None:
    with pytest.raises(ValueError, match="--url"):
        ClientConfig(base_url="localhost:8000", model="m")


def test_frozen_heap_keeps_existing_objects_out_of_collections_while_a_load_plays() -> None:
    import gc

    from loadtest.client import frozen_heap

    before = gc.get_freeze_count()
    with frozen_heap():
        assert gc.get_freeze_count() > before
    assert gc.get_freeze_count() == 0
