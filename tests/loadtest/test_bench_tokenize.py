"""bench_tokenize runs both paths of each pair and reports what it measured."""

from __future__ import annotations

from loadtest.bench_tokenize import run


def test_every_pair_is_measured_and_the_ratio_follows_from_it() -> None:
    out = run(rounds=1, texts=1)
    assert out["tokens"]["chat_cold"] > 4000 and out["tokens"]["prompt_cold"] > 6000
    for pair in (
        "chat_cold",
        "chat_cold_tiktoken",
        "prompt_cold",
        "prompt_cold_tiktoken",
        "template",
    ):
        row = out[pair]
        assert row["before_cpu_ms"] > 0 and row["after_cpu_ms"] > 0
        assert abs(row["cpu_ratio"] - row["after_cpu_ms"] / row["before_cpu_ms"]) < 0.01
