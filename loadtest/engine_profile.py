"""Measures the real engine's step times on this machine and fits an emulated-engine profile.

Runs the real ``ModelRunner`` (and the real sampler) with one torch thread over
a grid of steps — cold prefills, prefills after a cached prefix, decode
batches of several sizes and context lengths — timing each step in CPU
seconds of the calling thread (which, with one torch thread, is the step's
wall time on an otherwise idle core; wall time on this shared machine varies
several-fold), keeps the fastest of ``--repeats`` passes, and fits the
non-negative coefficients of ``worker.model.emulated.TimeModel`` by least
squares on relative error. Writes the profile JSON (with the measurements and
the command, as its sources) and prints one JSON object with the fit's error.

Usage: ``python -m loadtest.engine_profile [--model smollm2] [--out PATH]``; the
checked-in CPU profile came from
``python -m loadtest.engine_profile --repeats 6 --out worker/model/profiles/cpu-smollm2.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from dataclasses import asdict, fields
from typing import Any

from worker.engine.batch import SeqChunk
from worker.model.emulated import TimeModel

logger = logging.getLogger(__name__)

PREFILLS = ((64, 0), (256, 0), (512, 0), (1024, 0), (2048, 0), (64, 1024), (256, 1024), (64, 1984))
DECODES = ((1, 64), (1, 2048), (4, 512), (8, 64), (8, 512), (8, 2048), (16, 256), (32, 128))


def _chunks(kind: str, a: int, b: int, block_size: int) -> list[SeqChunk]:
    """``prefill``: one chunk of ``a`` tokens after ``b`` cached; ``decode``: ``a`` rows at ``b``."""
    if kind == "prefill":
        blocks = list(range(-(-(a + b) // block_size)))
        return [SeqChunk([1000 + i % 3000 for i in range(a)], b, blocks, True)]
    per_seq = -(-(b + 1) // block_size)
    return [
        SeqChunk([1000 + row], b, list(range(row * per_seq, (row + 1) * per_seq)), True)
        for row in range(a)
    ]


def features(chunks: list[SeqChunk]) -> list[float]:
    """The time model's regressors for one step, in ``TimeModel`` field order."""
    probe = TimeModel()
    out = []
    for f in fields(TimeModel):
        unit = TimeModel(**{**asdict(probe), f.name: 1.0})
        out.append(unit.step_time(chunks))
    return out


def nnls(rows: list[list[float]], targets: list[float]) -> list[float]:
    """Least squares with coefficients >= 0 (drop the most negative one, refit, repeat)."""
    import numpy as np

    a = np.array(rows, dtype=float)
    y = np.array(targets, dtype=float)
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return [float(c) for c in coef]


def time_step(runner: Any, sampler: Any, chunks: list[SeqChunk], params: Any) -> float:
    """CPU seconds this thread spends on one real step (forward pass and sampling).

    With one torch thread the step runs on the calling thread, so its CPU
    time is what the step takes on an otherwise idle core, however many other
    processes share the machine (wall time is not: see the module docstring).
    """
    started = time.thread_time()
    logits = runner.execute(chunks)
    sampler.sample(logits, [params] * len(chunks), [None] * len(chunks))
    return time.thread_time() - started


def measure(model: str, repeats: int) -> tuple[list[dict[str, Any]], dict]:
    import torch

    from worker.model.runner import ModelRunner
    from worker.model.sampler import Sampler

    torch.set_num_threads(1)  # one core: CPU time of this thread = the step's time
    runner = ModelRunner(model, block_size=16, num_blocks=32 * 140)
    sampler = Sampler()
    from worker.engine.sequence import SamplingParams

    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    results = []
    grid = [("prefill", n, s) for n, s in PREFILLS] + [("decode", b, c) for b, c in DECODES]
    for _ in range(2):  # warm-up: allocator and first-call costs
        runner.execute(_chunks("prefill", 128, 0, 16))
    best = [float("inf")] * len(grid)
    # Whole passes over the grid, so a burst of load elsewhere spoils one pass, not one point.
    for _ in range(repeats):
        for i, (kind, a, b) in enumerate(grid):
            best[i] = min(best[i], time_step(runner, sampler, _chunks(kind, a, b, 16), greedy))
    for (kind, a, b), seconds in zip(grid, best, strict=True):
        results.append({"kind": kind, "a": a, "b": b, "seconds": round(seconds, 6)})
        logger.info("%s %d/%d: %.4f s", kind, a, b, seconds)
    info = {"model": runner.model_name, "torch_threads": torch.get_num_threads()}
    return results, info


def fit(results: list[dict[str, Any]], block_size: int = 16) -> tuple[TimeModel, float]:
    """The fitted time model and its worst relative error over the measured steps."""
    rows, targets = [], []
    for r in results:
        x = features(_chunks(r["kind"], r["a"], r["b"], block_size))
        rows.append([v / r["seconds"] for v in x])  # relative error: every step counts alike
        targets.append(1.0)
    names = [f.name for f in fields(TimeModel)]
    model = TimeModel(**dict(zip(names, nnls(rows, targets), strict=True)))
    worst = max(
        abs(model.step_time(_chunks(r["kind"], r["a"], r["b"], block_size)) / r["seconds"] - 1)
        for r in results
    )
    return model, worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--out", default="")
    parser.add_argument("--name", default="cpu-smollm2")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    results, info = measure(args.model, args.repeats)
    model, worst = fit(results)
    command = "python -m loadtest.engine_profile " + " ".join(argv or sys.argv[1:])
    profile = {
        "name": args.name,
        "description": (
            f"{info['model']} fp32 on one core of this repository's CI machine "
            f"({platform.machine()}, 1 torch thread), measured from the real ModelRunner as "
            "CPU seconds per step, i.e. the wall time on an otherwise idle core"
        ),
        "sources": [
            f"measured here with `{command.strip()}` on {time.strftime('%Y-%m-%d')}: "
            "fastest of the repeats for each step in `measurements`",
        ],
        "time_model": {k: float(f"{v:.4g}") for k, v in asdict(model).items()},
        "kv_capacity_tokens": 65536,
        "max_model_len": 8192,
        "fit_worst_relative_error": round(worst, 3),
        "measurements": results,
    }
    if args.out:
        with open(args.out, "w", encoding="utf-8") as out:
            json.dump(profile, out, indent=2)
            out.write("\n")
    print(json.dumps({"time_model": profile["time_model"], "worst_relative_error": worst, **info}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
