"""``loadtest.bench_gateway`` runs end to end on the real tokenizer and Dispatcher (small)."""

from __future__ import annotations

from pathlib import Path

from loadtest.bench_gateway import run


def test_bench_gateway_routes_every_turn(smollm2: Path) -> None:
    result = run(str(smollm2), conversations=2, turns=3, words_per_message=20, workers=4, seed=0)
    routing = result["routing"]
    assert set(routing) == {"incremental+answer", "incremental", "full"}
    for mode in routing.values():
        assert mode["n"] == 2 * 3 and mode["p50_ms"] > 0
    # Incremental tokenization reuses the earlier turns' ids; the full mode never does.
    assert routing["incremental"]["prefix_cache_hits"] > 0
    assert "prefix_cache_hits" not in routing["full"]
