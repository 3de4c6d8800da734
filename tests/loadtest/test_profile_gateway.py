"""profile_gateway's split of py-spy's samples over a request's steps."""

from __future__ import annotations

from loadtest.profile_gateway import split_samples, step_of

ROOT = "_run_code (<frozen runpy>);main (gateway/cli.py:380);Runner.run (asyncio/runners.py:118)"


def test_each_sample_goes_to_its_innermost_step() -> None:
    serve = ROOT + ";serve (gateway/request_path.py:90)"
    assert step_of((serve + ";tokenize (gateway/request_path.py:200)").split(";")) == "tokenize"
    # The routing decision inside the worker call counts as the decision, not the call.
    inner = serve + ";Dispatcher.open (gateway/routing/dispatch.py:300)"
    inner += ";Router._kvroute_small (gateway/routing/router.py:500)"
    assert step_of(inner.split(";")) == "choose"
    assert step_of(ROOT.split(";")) is None  # the loop waiting: not the request's CPU
    assert step_of(["f (somewhere/else.py:1)"]) == "other"


def test_samples_are_counted_per_step_without_the_idle_loop() -> None:
    folded = "\n".join(
        [
            f"{ROOT};serve (gateway/request_path.py:90);read_json (gateway/request_path.py:9) 3",
            f"{ROOT};x (aiohttp/web_protocol.py:446) 5",
            f"{ROOT} 40",
            "garbage line",
        ]
    )
    assert split_samples(folded) == ({"parse": 3, "aiohttp": 5}, 8)
