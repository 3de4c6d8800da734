"""The dashboard page in a real headless Chromium (Playwright driving /usr/bin/chromium).

The live test runs a real fleet (Redis, two tiny-Llama workers, the gateway), puts it
under concurrent streaming load and checks that what the page shows is what
``/metrics`` says: during the load (bounded by scrapes taken before and after the page's
poll, and in-flight requests visible while they run) and exactly once it has drained.
The percentiles are recomputed here from the histogram buckets, independently of the
gateway's code.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from playwright.async_api import Page, async_playwright

from loadtest.fleet import Fleet, FleetConfig
from tests.gateway.conftest import HELLO_CACHED, MakeGateway

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})? (\S+)$")


async def test_dashboard_renders_rows_and_updates(
    make_gateway: MakeGateway, tmp_path: Path
) -> None:
    gateway = await make_gateway()
    await gateway.add_worker("alpha", cached_tokens=16)
    await gateway.add_worker("beta", cached_tokens=16)
    data = await (await gateway.client.get("/dashboard/data")).json()
    assert [w["worker_id"] for w in data["workers"]] == ["alpha", "beta"]
    url = str(gateway.client.make_url("/dashboard")) + "?interval=200"
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = await browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(url)
            await page.wait_for_selector("tr[data-worker='beta']")
            assert await page.locator("#workers tr").count() == 2
            # No traffic yet: no hit rate to show, rather than a misleading 0.0 %.
            before = await page.locator("td[data-col='hit_rate']").all_inner_texts()
            assert before == ["\u2013", "\u2013"]  # an en dash
            for _ in range(4):
                assert (await gateway.chat(HELLO_CACHED)).status == 200
            await page.wait_for_function(
                """() => [...document.querySelectorAll(".mix")]
                         .reduce((n, m) => n + Number(m.dataset.total || 0), 0) === 4""",
                timeout=5000,
            )
            after = await page.locator("td[data-col='hit_rate']").all_inner_texts()
            assert any(t.endswith("%") for t in after)
            assert await page.locator("#ready").inner_text() == "yes"
            shot = tmp_path / "dashboard.png"
            await page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 1000 and shot.read_bytes()[:4] == b"\x89PNG"
            assert errors == []
        finally:
            await browser.close()


async def test_dashboard_is_self_contained(make_gateway: MakeGateway) -> None:
    gateway = await make_gateway()
    html = await (await gateway.client.get("/dashboard")).text()
    assert "<script>" in html and "<style>" in html
    assert "http://" not in html and "https://" not in html and "src=" not in html


# -- live fleet ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tiny_llama: Path) -> Iterator[Fleet]:
    config = FleetConfig(model=str(tiny_llama), workers=2, num_blocks=256, startup_timeout=120)
    with Fleet(config) as f:
        yield f


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` as {(name, sorted labels): value}."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def total(metrics: dict[Any, float], name: str, **match: str) -> float:
    return sum(
        v
        for (n, labels), v in metrics.items()
        if n == name and all(dict(labels).get(k) == want for k, want in match.items())
    )


def quantile(q: float, metrics: dict[Any, float], name: str, **match: str) -> float | None:
    """Prometheus' histogram_quantile over the summed buckets (written here independently)."""
    buckets: dict[float, float] = {}
    for (n, labels), v in metrics.items():
        d = dict(labels)
        if n == name + "_bucket" and all(d.get(k) == w for k, w in match.items()):
            buckets[float(d["le"])] = buckets.get(float(d["le"]), 0.0) + v
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] == 0:
        return None
    rank = q * buckets[bounds[-1]]
    prev_bound, prev_count = 0.0, 0.0
    for b in bounds:
        if buckets[b] >= rank:
            if math.isinf(b):
                return prev_bound
            return prev_bound + (b - prev_bound) * (rank - prev_count) / (buckets[b] - prev_count)
        prev_bound, prev_count = b, buckets[b]
    return prev_bound


async def shown(page: Page) -> dict[str, Any]:
    """Waits for a fresh poll, then every number on the page by its key (raw data-v)."""
    polls = int(await page.evaluate("document.body.dataset.polls || 0"))
    await page.wait_for_function(f"Number(document.body.dataset.polls || 0) > {polls}")
    return await page.evaluate(
        """() => {
          const num = v => (v === "" || v === undefined ? null : Number(v));
          const fleet = {};
          for (const n of document.querySelectorAll("#fleet [data-k]"))
            fleet[n.dataset.k.slice(6)] = {v: num(n.dataset.v), text: n.textContent};
          const workers = {};
          for (const tr of document.querySelectorAll("#workers tr")) {
            const w = {};
            for (const td of tr.querySelectorAll("td[data-col]"))
              if (td.dataset.v !== undefined) w[td.dataset.col] = num(td.dataset.v);
            const blocks = tr.querySelector("td[data-col='blocks'] .text");
            w.blocks_used = Number(blocks.dataset.used); w.blocks_total = Number(blocks.dataset.total);
            const tok = tr.querySelectorAll("td[data-col='tokens'] span");
            w.prompt_tokens_per_s = num(tok[0].dataset.v);
            w.generation_tokens_per_s = num(tok[1].dataset.v);
            workers[tr.dataset.worker] = w;
          }
          return {fleet, workers, window: Number(document.body.dataset.window)};
        }"""
    )


async def _load(url: str, model: str, stop: asyncio.Event, counts: list[int]) -> None:
    """One client: streamed chats, one after another, until ``stop``."""
    async with aiohttp.ClientSession() as session:
        i = 0
        while not stop.is_set():
            body = {
                "model": model,
                "messages": [{"role": "user", "content": f"dashboard load {i % 3} " * 30}],
                "max_tokens": 48,
                "stream": True,
                "ignore_eos": True,
            }
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                async for _ in resp.content:
                    pass
            counts.append(1)
            i += 1


async def test_dashboard_numbers_match_metrics_under_live_load(
    fleet: Fleet, tmp_path: Path
) -> None:
    url = fleet.gateway_url
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    stop, done = asyncio.Event(), []
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = await browser.new_page(viewport={"width": 1600, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            # A window longer than the test: the page's rates times the window are totals.
            await page.goto(url + "/dashboard?interval=250&window=3600")
            await page.wait_for_selector("#workers tr")
            clients = [asyncio.create_task(_load(url, model, stop, done)) for _ in range(6)]
            # 1. Under load: requests in flight show up while they run, not only once done.
            inflight_seen = 0.0
            for _ in range(40):
                now = await shown(page)
                inflight_seen = max(inflight_seen, now["fleet"]["inflight"]["v"] or 0)
                if inflight_seen > 0 and len(done) >= 6:
                    break
            assert inflight_seen > 0, "the page never showed a request in flight"
            before = await asyncio.to_thread(scrape, url)
            now = await shown(page)
            after = await asyncio.to_thread(scrape, url)
            await page.screenshot(path=str(tmp_path / "dashboard-load.png"), full_page=True)
            span = now["window"]
            for wid in ("worker-0", "worker-1"):
                for key, name in (
                    ("requests_per_s", "kvroute_gateway_requests_total"),
                    ("prompt_tokens_per_s", "kvroute_gateway_prompt_tokens_total"),
                ):
                    low = total(before, name, worker_id=wid)
                    high = total(after, name, worker_id=wid)
                    value = now["workers"][wid][key] * span
                    assert low - 1e-6 * high - 2 <= value <= high + 1e-6 * high + 2, (wid, key)
            assert now["fleet"]["requests_per_s"]["v"] > 0
            stop.set()
            await asyncio.gather(*clients)
            # 2. Drained: every figure equals what /metrics gives for the same span.
            await asyncio.sleep(0.5)
            metrics = await asyncio.to_thread(scrape, url)
            final = await shown(page)
            span = final["window"]
            f = final["fleet"]
            assert f["inflight"]["v"] == 0 and f["errors_per_s"]["v"] == 0
            assert f["healthy_workers"]["v"] == 2 and f["workers"]["v"] == 2
            requests = total(metrics, "kvroute_gateway_requests_total")
            assert requests == len(done) > 0
            assert f["requests_per_s"]["v"] * span == pytest.approx(requests, rel=1e-6)
            prompt = total(metrics, "kvroute_gateway_prompt_tokens_total")
            cached = total(metrics, "kvroute_gateway_cached_tokens_total")
            predicted = total(metrics, "kvroute_gateway_predicted_cached_tokens_total")
            generated = total(metrics, "kvroute_gateway_generation_tokens_total")
            assert generated == 48 * len(done)
            assert f["hit_rate"]["v"] == pytest.approx(cached / prompt, rel=1e-9)
            assert f["predicted_hit_rate"]["v"] == pytest.approx(predicted / prompt, rel=1e-9)
            assert f["hit_rate"]["text"] == f"{100 * cached / prompt:.1f}%"
            assert f["generation_tokens_per_s"]["v"] * span == pytest.approx(generated, rel=1e-6)
            for q, key in ((0.5, "ttft_p50_s"), (0.95, "ttft_p95_s"), (0.99, "ttft_p99_s")):
                want = quantile(q, metrics, "kvroute_gateway_ttft_seconds")
                assert f[key]["v"] == pytest.approx(want, rel=1e-9), key
            for wid, w in final["workers"].items():
                p = total(metrics, "kvroute_gateway_prompt_tokens_total", worker_id=wid)
                c = total(metrics, "kvroute_gateway_cached_tokens_total", worker_id=wid)
                r = total(metrics, "kvroute_gateway_requests_total", worker_id=wid)
                assert w["requests_per_s"] * span == pytest.approx(r, rel=1e-6)
                assert (w["hit_rate"] is None) if p == 0 else w["hit_rate"] == pytest.approx(c / p)
                assert w["inflight"] == 0
                # Block states add up, and the capacity is the worker's own.
                worker = next(x for x in fleet.workers if x.worker_id == wid)
                own = await asyncio.to_thread(scrape, worker.http_url)
                assert w["blocks_used"] + w["blocks.free"] == w["blocks_total"]
                assert w["blocks_total"] == total(own, "kvroute_worker_block_capacity") == 256
            await page.screenshot(path=str(tmp_path / "dashboard-drained.png"), full_page=True)
            assert (tmp_path / "dashboard-load.png").stat().st_size > 10_000
            assert errors == []
        finally:
            stop.set()
            await browser.close()
