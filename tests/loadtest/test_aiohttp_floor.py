"""The aiohttp floor answers as an OpenAI server would, without routing anything."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer

from loadtest.aiohttp_floor import app


async def test_the_floor_answers_whole_and_streamed_requests() -> None:
    async with TestClient(TestServer(app())) as client:
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        resp = await client.post("/v1/chat/completions", json=chat)
        whole = await resp.json()
        assert resp.status == 200 and whole["choices"][0]["message"]["content"] == " a a a"
        assert whole["usage"]["completion_tokens"] == 3
        resp = await client.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}
        )
        events = (await resp.read()).decode().split("\n\n")
        assert resp.headers["Content-Type"] == "text/event-stream"
        assert [e for e in events if e] == [e for e in events if e.startswith("data: ")] and events[
            -2
        ] == "data: [DONE]"
        assert len([e for e in events if '"text":" a"' in e]) == 2
        resp = await client.post("/v1/completions", data=b"not json")
        assert resp.status == 400


async def test_the_proxy_relays_bytes_round_robin() -> None:
    # Two floors as workers, a proxy in front: answers come back unchanged, whole and
    # streamed.
    async with (
        TestClient(TestServer(app())) as w0,
        TestClient(TestServer(app())) as w1,
    ):
        urls = [str(w.make_url("")) for w in (w0, w1)]
        async with TestClient(TestServer(app(urls))) as proxy:
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            for _ in range(2):
                resp = await proxy.post("/v1/chat/completions", json=chat)
                assert (await resp.json())["choices"][0]["message"]["content"] == " a a"
            resp = await proxy.post(
                "/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True}
            )
            text = (await resp.read()).decode()
            assert text.count('"text":" a"') == 3 and text.endswith("data: [DONE]\n\n")
