"""What the gateway routes to when heartbeats report a stalled engine or a small context.

Fake gRPC workers register real records in a real Redis; the gateway's mirror reads
them. A worker whose heartbeat says its engine has not stepped for longer than
``--engine-stall-s`` gets no request while another worker steps; when every worker
says so, they all keep serving (a slow fleet beats a 503). Context length is per
worker: a prompt goes to a worker it fits, and ``/v1/models`` reports the largest.
"""

from __future__ import annotations

from tests.gateway.conftest import MakeGateway
from tests.gateway.helpers import eventually

HELLO = [{"role": "user", "content": "hello there"}]


async def test_stalled_engine_is_skipped_unless_all_are(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway(engine_stall_s=5.0)
    _, reg_a = await gateway.add_worker("a")
    _, reg_b = await gateway.add_worker("b")
    await reg_a.register(engine_step_age_s=30.0)

    def a_stalled() -> bool:
        return gateway.state.mirror.workers["a"].record.engine_step_age_s == 30.0

    await eventually(a_stalled, what="the stalled heartbeat mirrored")
    for _ in range(4):
        resp = await gateway.chat(HELLO)
        assert resp.status == 200 and resp.headers["x-kvroute-worker"] == "b"
    await reg_b.register(engine_step_age_s=30.0)
    await eventually(
        lambda: gateway.state.mirror.workers["b"].record.engine_step_age_s == 30.0,
        what="both stalled",
    )
    served = set()
    for _ in range(6):
        resp = await gateway.chat(HELLO)
        assert resp.status == 200, await resp.text()
        served.add(resp.headers["x-kvroute-worker"])
    assert served <= {"a", "b"} and served
    metrics = await (await gateway.client.get("/metrics")).text()
    assert 'kvroute_gateway_registry_records_rejected_total{reason="engine_stalled"}' in metrics


async def test_context_length_is_per_worker(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    await gateway.add_worker("small", max_model_len=64)
    await gateway.add_worker("big", max_model_len=4096)
    models = await (await gateway.client.get("/v1/models")).json()
    assert models["data"][0]["max_model_len"] == 4096  # the largest, not the smallest
    long = [{"role": "user", "content": "a long question " * 40}]
    for _ in range(4):
        resp = await gateway.chat(long, max_tokens=8)
        assert resp.status == 200 and resp.headers["x-kvroute-worker"] == "big"
    resp = await gateway.chat(HELLO, max_tokens=4)
    assert resp.status == 200
