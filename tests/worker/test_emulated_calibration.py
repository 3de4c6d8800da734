"""The CPU profile against the real engine it was measured from (SmolLM2-135M, fp32, one core).

The same three measurements run on the real Engine + ModelRunner and on the
real Engine + EmulatedRunner with ``cpu-smollm2``: TTFT of a cold prompt,
TTFT of a prompt whose first blocks a sibling just cached, and decode
tokens/s of a batch of concurrent requests. The *shape* must agree: each
measurement's emulated/real ratio within 20 % of the three ratios' median. The
overall scale must agree more loosely (the median within x1.6 of 1).

Times are *engine seconds*: the CPU time of the engine thread (one torch
thread, so the forward pass runs on it) plus, for the emulated engine, the
time it slept for the model. On an otherwise idle core that is the wall time;
on this shared machine (other jobs keep the load at 4-12 on two cores) wall
times change several-fold from one minute to the next, engine seconds do not.
The profile (``loadtest.engine_profile``) is measured the same way. CPU time
still drifts with what shares the core (the two "cores" here are hyperthreads,
and other jobs' load changes cache and memory bandwidth), and hosts differ in
shape too (AVX2 against AVX-512: prefill and decode slow by different factors),
so the emulated engine runs each step kind scaled by how much slower that kind's
reference step runs now than in the profile's ``measurements`` (timed before and
after the real runs). The reference steps are the scenario's own shapes (a cold
512-token prompt, a decode batch of 8 at short context): with a decode step at
context 512 as the reference, a CI host that decodes short contexts relatively
faster failed the shape check at x1.19. That scale is itself noisy: one CI run
drifted from x2.68 to x2.18 between the before and after probes. So the tight
check is on the shape (cold vs hit vs decode, which a wrong time model breaks)
and the loose one on the scale; the message shows both.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from contract.hashing import HashSpec
from worker.engine.sequence import SamplingParams
from worker.engine.thread import Engine, EngineConfig
from worker.model.emulated import (
    EmulatedRunner,
    EmulatedSampler,
    TimeModel,
    load_profile,
    resolve_profile,
)

PROFILE = "cpu-smollm2"
REFERENCE_STEPS = (("prefill", 512, 0), ("decode", 8, 64))
REFERENCE_STEPS_KINDS = tuple(step[0] for step in REFERENCE_STEPS)
PROMPT, SHARED = 512, 448
BATCH, DECODE_PROMPT, NEW_TOKENS = 8, 32, 24
TOLERANCE = 0.20
SCALE_TOLERANCE = 1.6


def prompt(seed: int, n: int) -> list[int]:
    return [1000 + (seed * 7919 + i * 104729) % 40000 for i in range(n)]


@dataclass(frozen=True)
class PerKindScaled:
    """A time model whose steps run ``scale[kind]`` times slower, the kind as the profile's
    measurements name it: a step with any prompt chunk is a prefill, else a decode."""

    model: TimeModel
    scale: dict[str, float]

    def step_time(self, chunks: Sequence[Any]) -> float:
        kind = "prefill" if any(len(c.token_ids) > 1 for c in chunks) else "decode"
        return self.model.step_time(chunks) * self.scale[kind]


class EngineClock:
    """Engine seconds so far: the engine thread's CPU time plus the emulated runner's sleep.

    ``older`` are the threads that ran before this engine started. The previous
    engine's thread can outlive its ``shutdown`` by a moment; once, in CI, its
    clock was read instead, stood still, and a decode batch took 0 s.
    """

    def __init__(self, runner: Any, older: set[threading.Thread]) -> None:
        self.runner = runner
        engine_thread = next(
            t for t in threading.enumerate() if t.name == "kvroute-engine" and t not in older
        )
        assert engine_thread.ident is not None
        self.clock = time.pthread_getcpuclockid(engine_thread.ident)

    def now(self) -> float:
        return time.clock_gettime(self.clock) + getattr(self.runner, "busy_s", 0.0)


async def request(engine: Engine, clock: EngineClock, rid: str, ids: list[int], n: int) -> float:
    """Engine seconds to the first token (the request runs on to ``n`` tokens)."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    started, ttft = clock.now(), None
    async for out in engine.generate(rid, ids, params):
        if out.new_token_ids and ttft is None:
            ttft = clock.now() - started
    assert ttft is not None
    return ttft


async def scenario(engine: Engine, clock: EngineClock) -> dict[str, float]:
    """Cold TTFT, hit TTFT and batched decode tokens/s on ``engine``, each the best of two."""
    await request(engine, clock, "warmup", prompt(1, 64), 4)
    cold, hit = [], []
    for k in range(2):
        cold.append(await request(engine, clock, f"cold{k}", prompt(10 + k, PROMPT), 1))
        base = prompt(20 + k, PROMPT)
        sibling = base[:SHARED] + prompt(30 + k, PROMPT - SHARED)
        await request(engine, clock, f"sib{k}", sibling, 1)
        hit.append(await request(engine, clock, f"hit{k}", base, 1))
    decode = []
    for k in range(2):
        started = clock.now()
        await asyncio.gather(
            *(
                request(
                    engine,
                    clock,
                    f"d{k}-{i}",
                    prompt(40 + i + BATCH * k, DECODE_PROMPT),
                    NEW_TOKENS,
                )
                for i in range(BATCH)
            )
        )
        decode.append(BATCH * NEW_TOKENS / (clock.now() - started))
    return {"ttft_cold_s": min(cold), "ttft_hit_s": min(hit), "decode_tokens_per_s": max(decode)}


def run_engine(runner: Any, sampler: Any = None) -> dict[str, float]:
    engine = Engine(
        runner,
        EngineConfig(max_num_seqs=BATCH, max_batch_tokens=2048),
        hash_spec=HashSpec(block_size=16, model="calibration"),
        sampler=sampler,
    )
    older = set(threading.enumerate())
    engine.start()
    try:
        return asyncio.run(scenario(engine, EngineClock(runner, older)))
    finally:
        engine.shutdown()


def slowdown_now(runner: Any) -> dict[str, float]:
    """Per step kind, CPU time of its reference step now over its time in the profile's
    measurements."""
    from loadtest.engine_profile import _chunks, time_step
    from worker.model.sampler import Sampler

    raw = json.loads(resolve_profile(PROFILE).read_text())["measurements"]
    measured = {(m["kind"], m["a"], m["b"]): m["seconds"] for m in raw}
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    ratios = {}
    for key in REFERENCE_STEPS:
        best = min(time_step(runner, Sampler(), _chunks(*key, 16), greedy) for _ in range(3))
        ratios[key[0]] = best / measured[key]
    return ratios


# Reference steps that moved more than this during the real engine's run: a disturbed run.
STEADY_DRIFT = 0.05
STEADY_ATTEMPTS = 3


def test_cpu_profile_matches_the_real_engine(smollm2: Path) -> None:
    import torch

    from worker.model.runner import ModelRunner

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner = ModelRunner(smollm2, block_size=16, num_blocks=1024)
        # The real engine is measured between two reads of the reference steps; when
        # they drift apart something else took the cores meanwhile (in CI, a process
        # of the test before still exiting), so measure again, up to a few times.
        attempts = []
        for _ in range(STEADY_ATTEMPTS):
            before = slowdown_now(runner)
            real = run_engine(runner)
            after = slowdown_now(runner)
            drift = max(abs(after[kind] / before[kind] - 1) for kind in before)
            attempts.append((drift, before, real, after))
            if drift <= STEADY_DRIFT:
                break
    finally:
        torch.set_num_threads(threads)
    # Whatever else runs on the cores only adds CPU time (shared caches, a busy
    # hyperthread sibling), so each figure's quickest reading over the attempts is the
    # least disturbed one: real figures and reference steps alike. Pairing them by
    # attempt instead failed once when every attempt drifted 7 % and the decode
    # batch was slowed in a different moment than the reference steps around it.
    real = {
        "ttft_cold_s": min(a[2]["ttft_cold_s"] for a in attempts),
        "ttft_hit_s": min(a[2]["ttft_hit_s"] for a in attempts),
        "decode_tokens_per_s": max(a[2]["decode_tokens_per_s"] for a in attempts),
    }
    probes = [probe for a in attempts for probe in (a[1], a[3])]
    drift = min(a[0] for a in attempts)
    # Each kind scaled by its own slowdown: the decode figure's batch also prefills its
    # prompts, so scaling whole figures (as this test once did) gave that prefill the
    # decode factor.
    scale = {kind: min(probe[kind] for probe in probes) for kind in REFERENCE_STEPS_KINDS}
    profile = load_profile(PROFILE)
    profile = replace(profile, time_model=PerKindScaled(profile.time_model, scale))
    # The emulated engine sleeps its time model: anything else on the cores can only
    # add to that, never take from it, so the quicker of two runs is the model's own
    # figure (in CI one run decoded 25 % under the model, failing the shape check).
    runs = [
        run_engine(
            EmulatedRunner(profile, smollm2, block_size=16, num_blocks=1024, time_scale=1.0),
            EmulatedSampler(),
        )
        for _ in range(2)
    ]
    emulated = {
        "ttft_cold_s": min(r["ttft_cold_s"] for r in runs),
        "ttft_hit_s": min(r["ttft_hit_s"] for r in runs),
        "decode_tokens_per_s": max(r["decode_tokens_per_s"] for r in runs),
    }
    # Emulated over real, all as times (decode as seconds per token).
    ratios = {
        "ttft_cold_s": emulated["ttft_cold_s"] / real["ttft_cold_s"],
        "ttft_hit_s": emulated["ttft_hit_s"] / real["ttft_hit_s"],
        "decode_tokens_per_s": real["decode_tokens_per_s"] / emulated["decode_tokens_per_s"],
    }
    overall = sorted(ratios.values())[1]
    detail = (
        f"real {real}, emulated {emulated} scaled by {scale} "
        f"(reference steps {probes}, least drift {drift:.3f} in "
        f"{len(attempts)} attempts); emulated/real {ratios}"
    )
    for key, ratio in ratios.items():
        assert ratio == pytest.approx(overall, rel=TOLERANCE), f"shape, {key}: {detail}"
    assert 1 / SCALE_TOLERANCE <= overall <= SCALE_TOLERANCE, f"scale: {detail}"
