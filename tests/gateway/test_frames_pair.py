"""The frames port end to end: a real worker process on tiny_llama with ``--frames-port``,
a real gateway in front of it, the ``openai`` SDK as the client.

The gateway carries its requests on the worker's frames port (the worker's own
``kvroute_worker_frames_connections_total`` says so), and what comes back is
what the worker's own HTTP front answers to the same greedy request: streamed,
unstreamed, and many at once on the one connection.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.gateway.pair import Pair, serve_pair

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair(
    tiny_llama: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    logs = tmp_path_factory.mktemp("frames-logs")
    with serve_pair(tiny_llama, redis_url, logs, frames=True) as p:
        yield p


def _frames_connections(pair: Pair) -> float:
    url = f"http://127.0.0.1:{pair.worker.extra['http_port']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    found = re.search(r"^kvroute_worker_frames_connections_total\{[^}]*\} (\S+)$", text, re.M)
    assert found, "the worker exports no frames connection counter"
    return float(found.group(1))


def _complete(client: object, model: str, prompt: list[int], stream: bool) -> str:
    args = dict(
        model=model, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    completions = client.completions  # type: ignore[attr-defined]
    if not stream:
        return str(completions.create(**args).choices[0].text)
    return "".join(c.choices[0].text for c in completions.create(**args, stream=True) if c.choices)


def test_the_gateway_connects_to_a_worker_it_discovers_before_any_request(pair: Pair) -> None:
    # Runs first in this module: no request has been sent through the pair yet.
    deadline = time.monotonic() + 20
    while _frames_connections(pair) < 1:
        assert time.monotonic() < deadline, "the gateway never connected to the frames port"
        time.sleep(0.1)


def test_requests_ride_the_frames_port_and_answer_as_the_worker_does(pair: Pair) -> None:
    gateway, worker, name = pair.client(), pair.worker_client(), pair.name
    prompts = [[1, 450, 4996 + i, 17354, 1701, 432, 17204] for i in range(8)]
    for stream in (False, True):
        for prompt in prompts[:2]:
            assert _complete(gateway, name, prompt, stream) == _complete(
                worker, name, prompt, stream
            )
    # Many at once share the one connection and each gets its own answer.
    with ThreadPoolExecutor(8) as pool:
        through_gateway = list(pool.map(lambda p: _complete(gateway, name, p, True), prompts))
    assert through_gateway == [_complete(worker, name, p, False) for p in prompts]
    assert _frames_connections(pair) == 1
