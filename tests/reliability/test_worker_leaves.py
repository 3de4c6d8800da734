"""A worker that leaves the fleet loses no request: a rolling restart and a hung worker.

Rolling restart: two real workers, each SIGTERMed in turn (and started again)
while 30 streaming conversations run through a real gateway. The worker
deregisters first, refuses new calls (the gateway retries them elsewhere before
their first token) and finishes the streams it has; the gateway keeps a
departed worker's channel open for those streams. Every stream must end with a
finish reason and ``[DONE]``, with no error and no non-200 answer.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from loadtest.fleet import Fleet, FleetConfig
from tests.reliability.fleetkit import StreamResult, call, dashboard, model_name, stream
from tests.support import RedisProcess

pytestmark = pytest.mark.slow

CONVERSATIONS = 30


@pytest.fixture(scope="module")
def fleet(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    proc = RedisProcess().start()
    config = FleetConfig(
        model=str(tiny_llama),
        workers=2,
        redis_url=proc.url,
        namespace="kvleaves",
        num_blocks=1024,
        max_num_seqs=8,
        heartbeat_interval=0.5,
        heartbeat_ttl=2.0,
        log_dir=str(tmp_path_factory.mktemp("leaves-logs")),
        gateway_args=("--log-level", "warning"),
    )
    try:
        with Fleet(config) as f:
            yield f
    finally:
        proc.close()


def _restart(fleet: Fleet, worker_id: str) -> None:
    """SIGTERM ``worker_id``, wait for its drain to end, start it again under the same id."""
    i = next(i for i, w in enumerate(fleet.workers) if w.worker_id == worker_id)
    old = fleet.workers.pop(i)
    old.proc.send_signal(signal.SIGTERM)
    assert old.proc.wait(timeout=60) == 0
    fleet.start_worker(int(worker_id.rsplit("-", 1)[1]))
    fleet.wait_ready()


async def test_rolling_restart_under_streaming_conversations(fleet: Fleet) -> None:
    model = model_name(fleet)
    url = fleet.gateway_url + "/v1/chat/completions"
    results: list[StreamResult] = []
    stop = asyncio.Event()

    async def conversation(n: int, session: aiohttp.ClientSession) -> None:
        messages = [{"role": "user", "content": f"conversation {n}: tell me a story"}]
        while not stop.is_set():
            body = {"model": model, "messages": messages, "max_tokens": 24, "ignore_eos": True}
            res = await stream(session, url, body, headers={"X-Session-ID": f"conv-{n}"})
            results.append(res)
            messages = [
                *messages[-5:],
                {"role": "assistant", "content": res.text},
                {"role": "user", "content": f"and then? ({len(results)})"},
            ]

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        tasks = [asyncio.create_task(conversation(n, session)) for n in range(CONVERSATIONS)]
        await asyncio.sleep(2.0)
        served_before: dict[str, int] = {}
        for w in ["worker-0", "worker-1"]:
            served_before[w] = sum(r.worker == w for r in results)
            await asyncio.to_thread(_restart, fleet, w)
            await asyncio.sleep(1.0)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 120)

    bad = [r for r in results if not r.ok]
    assert not bad, (len(bad), len(results), [(r.status, r.error, r.done) for r in bad[:3]])
    assert len(results) >= 3 * CONVERSATIONS
    # Both workers served traffic before their restart, and both are back in the fleet.
    assert all(served_before.values()), served_before
    rows = dashboard(fleet.gateway_url)
    assert set(rows) == {"worker-0", "worker-1"} and all(r["healthy"] for r in rows.values())
    assert call(fleet.gateway_url + "/readyz").body["healthy_workers"] == 2
