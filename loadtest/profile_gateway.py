"""Where a router's CPU goes, step by step: py-spy on the gateway under bench_overhead's load.

Starts ``bench_overhead``'s instant fakes and one router (``kvroute`` by default;
any of its routers), loads it at ``--concurrency`` for ``--seconds`` while
``py-spy record`` samples the router process, and prints one JSON object: the
CPU a request (psutil, the truth: py-spy also samples time the process waited
for a core) and that CPU split over the request's steps. Each sample goes to the
innermost step in its stack (``STEPS``, first match from the leaf), so a step's
figure excludes the steps it calls; samples of the idle event loop are left out.

    python -m loadtest.profile_gateway --router kvroute --workload chat_small
    python -m loadtest.profile_gateway --router kvroute_http --workload chat_6k_repeat

Needs ``py-spy`` (the ``loadtest`` extra) and the right to trace the router
(root, or ``CAP_SYS_PTRACE`` in a container).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from loadtest.bench_overhead import ROUTERS, WORKLOADS, _load, fake_fleet, make_bodies
from loadtest.fleet import sigterm_as_ctrl_c

# A request's steps, each named by pieces of the frames that belong to it.
STEPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("metrics", ("prometheus_client", "gateway/observe/")),
    (
        "parse",
        (
            "read_json",
            "parse_chat",
            "parse_completion",
            "parse_sampling",
            "openai_api/requests",
            "openai_api/messages",
            "openai_api/json_body",
        ),
    ),
    (
        "tokenize",
        (
            "tokenize (gateway/request_path",
            "gateway/text/",
            "jinja2",
            "<template>",
            "tiktoken",
            "tokenizers",
        ),
    ),
    ("hash_and_look_up", ("Dispatcher.hash", "look_up", "gateway/routing/index", "block_hashes")),
    (
        "choose",
        (
            "Dispatcher.choose",
            "gateway/routing/router",
            "gateway/routing/load",
            "gateway/routing/sessions",
            "prefix_demand",
            "speculation",
        ),
    ),
    (
        "worker_call",
        (
            "gateway/upstream/",
            "contract/frames",
            "contract/prompt_wire",
            "contract/call_frames",
            "Dispatcher.open",
            "_first_chunk",
            "open_choices",
        ),
    ),
    ("relay", ("gateway/edge/relay", "openai_api/detokenizer", "send_now")),
    ("aiohttp", ("aiohttp/",)),
    ("dispatch_other", ("gateway/routing/",)),
    ("request_path", ("gateway/request_path",)),
    ("edge", ("gateway/edge/",)),
)
_IDLE = ("Runner.run (", "run_forever (", "run_until_complete (")


def step_of(frames: list[str]) -> str | None:
    """The innermost step of a stack (root first); None for the idle loop itself."""
    if frames and frames[-1].startswith(_IDLE):
        return None
    for frame in reversed(frames):
        for name, pieces in STEPS:
            if any(p in frame for p in pieces):
                return name
    return "other"


def split_samples(folded: str) -> tuple[dict[str, int], int]:
    """py-spy's raw (folded) output -> samples per step, and the busy samples in all."""
    steps: collections.Counter[str] = collections.Counter()
    for line in folded.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        step = step_of(stack.split(";"))
        if step is not None:
            steps[step] += int(count)
    return dict(steps), sum(steps.values())


def profile(
    router: str,
    workload: str,
    concurrency: int,
    seconds: float,
    rate: int,
    raw_out: Path | None = None,
) -> Any:
    spy_bin = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy_bin).exists():
        raise SystemExit("py-spy is not installed: pip install py-spy (the loadtest extra)")
    with fake_fleet(4) as fleet:
        proc = fleet.router(router)
        try:
            bodies = make_bodies(workload, 200, seed=0)
            proc.wait_ready(bodies[0])
            asyncio.run(_load(proc.url, bodies, concurrency, 2.0))  # warm
            out = fleet.tmp / "samples.txt"
            pid, duration = str(proc.proc.pid), str(max(1, round(seconds)))
            spy = subprocess.Popen(
                [
                    spy_bin,
                    "record",
                    "-f",
                    "raw",
                    "-r",
                    str(rate),
                    "--nonblocking",
                    "-o",
                    str(out),
                    "-p",
                    pid,
                    "-d",
                    duration,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            cpu0 = proc.cpu_s()
            run = asyncio.run(_load(proc.url, bodies, concurrency, seconds))
            cpu = proc.cpu_s() - cpu0
            _, err = spy.communicate(timeout=60)
            if spy.returncode != 0 or not out.exists():
                raise SystemExit(f"py-spy failed: {err.decode(errors='replace').strip()[-300:]}")
            samples = out.read_text()
            if raw_out is not None:
                raw_out.write_text(samples)
        finally:
            proc.close()
    n = len(run["latencies_ms"])
    cpu_ms = cpu * 1e3 / max(1, n)
    steps, busy = split_samples(samples)
    return {
        "benchmark": "where a router's CPU goes a request, by step (py-spy)",
        "router": router,
        "workload": workload,
        "concurrency": concurrency,
        "requests": n,
        "cpu_ms_per_request": round(cpu_ms, 3),
        "busy_samples": busy,
        # Each step's share of the busy samples, scaled to the measured CPU.
        "steps_ms": {
            k: round(v / busy * cpu_ms, 4) for k, v in sorted(steps.items(), key=lambda kv: -kv[1])
        }
        if busy
        else {},
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.profile_gateway", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--router", default="kvroute", choices=ROUTERS)
    parser.add_argument("--workload", default="chat_small", choices=WORKLOADS)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rate", type=int, default=500, help="py-spy samples a second")
    parser.add_argument(
        "--raw-out",
        type=Path,
        help="also keep py-spy's folded stacks here (for a flame graph or a closer look)",
    )
    args = parser.parse_args(argv)
    if args.router.endswith("_baseline"):
        parser.error("a *_baseline router needs bench_overhead's --baseline-tree")
    with sigterm_as_ctrl_c():
        result = profile(
            args.router, args.workload, args.concurrency, args.seconds, args.rate, args.raw_out
        )
    result["command"] = "python -m loadtest.profile_gateway " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
