"""The dashboard page in a real headless Chromium (Playwright driving /usr/bin/chromium)."""

from __future__ import annotations

import shutil
from pathlib import Path

from playwright.async_api import async_playwright

from tests.gateway.conftest import HELLO_CACHED, MakeGateway

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


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
            rows = page.locator("#workers tr")
            assert await rows.count() == 2
            before = await page.locator("tr[data-worker] td[data-col='actual']").all_inner_texts()
            assert before == ["0.0%", "0.0%"]
            for _ in range(4):
                resp = await gateway.chat(HELLO_CACHED)
                assert resp.status == 200
            # The numbers change once the page polls again after the traffic.
            await page.wait_for_function(
                """() => [...document.querySelectorAll(".mix")]
                         .reduce((n, m) => n + Number(m.dataset.total || 0), 0) === 4""",
                timeout=5000,
            )
            after = await page.locator("tr[data-worker] td[data-col='actual']").all_inner_texts()
            assert after != before
            total = 0
            for wid in ("alpha", "beta"):
                mix = page.locator(f"tr[data-worker='{wid}'] td[data-col='reasons'] .mix")
                total += int(await mix.get_attribute("data-total") or 0)
            assert total == 4
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
