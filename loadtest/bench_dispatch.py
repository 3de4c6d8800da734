"""The gateway's routing steps over a synthetic fleet, comparable across checkouts.

``bench_scale``'s fleet (shared system prompts, conversations, spill) in an
in-process index, and the gateway's own ``Dispatcher`` doing a request's
routing steps (candidates -> block chain -> index walk -> router) for a hit
on a sampled conversation and for a miss, with the loads changing between
requests as the gateway's would (each routed request adds one, one routed
eight earlier finishes) and every record changing every 500 requests.
Thread CPU time per request; one JSON object.

It uses only what every checkout since the dispatcher's rows had, so the same
file times an earlier build: ``--checkout DIR`` runs it in DIR (a ``git
worktree`` of that build), with DIR's packages; alternate it with a run here.

    python -m loadtest.bench_dispatch --workers 1000 --blocks 2000
    git worktree add /tmp/kvroute-base f6c3f76
    python -m loadtest.bench_dispatch --checkout /tmp/kvroute-base
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # ``--checkout`` runs this file there: that checkout's packages
    sys.path.insert(0, os.getcwd())

from gateway.routing.index import BlockIndex
from gateway.routing.load import GatewayLoad
from loadtest.scale_dispatcher import chain_job, fleet_dispatcher


def _load_of(dispatcher: Any, worker_id: str) -> GatewayLoad:
    """The worker's load, noted as changed where the checkout tracks that."""
    load: GatewayLoad = dispatcher.loads.setdefault(worker_id, GatewayLoad())
    touched = getattr(dispatcher.loads, "touched", None)
    if touched is not None:
        touched.add(worker_id)
    return load


def sent_and_finished(dispatcher: Any, worker_id: str, sent: deque[str], n: int) -> None:
    """What the gateway changes between two requests: the routed one's load goes up,
    a request routed 8 earlier finishes, and every 500 requests (a registry poll
    at 1,000 req/s) the workers' records change, so the router's rows are rebuilt.
    (``bench_scale`` calls it too.)"""
    _load_of(dispatcher, worker_id).inflight += 1
    sent.append(worker_id)
    if len(sent) > 8:
        done = _load_of(dispatcher, sent.popleft())
        done.inflight -= 1
        done.finished += 1
    if n % 500 == 499:
        dispatcher.mirror.changes += 1


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 3)


def run(workers: int, blocks: int, requests: int, seed: int = 1) -> dict[str, Any]:
    from loadtest.bench_scale import Fleet  # here: bench_scale imports this module

    fleet = Fleet(workers, blocks)
    index = BlockIndex()
    ids = [f"w{i}" for i in range(workers)]
    for i, wid in enumerate(ids):
        index.replace(wid, fleet.worker_hashes(i).tolist())
    rng = random.Random(seed)
    dispatcher = fleet_dispatcher(index, ids, {w: rng.randrange(0, 8) for w in ids})
    gc.collect()
    sent: deque[str] = deque()
    hit, miss = [], []
    clock = time.thread_time
    for n in range(requests):
        _, chain = fleet.samples[n % len(fleet.samples)]
        job = chain_job(chain)
        t0 = clock()
        cands = dispatcher.hash(job, dispatcher.candidates())
        decision = dispatcher.choose(job, cands, dispatcher.look_up(cands))
        hit.append(clock() - t0)
        sent_and_finished(dispatcher, decision.worker_id, sent, n)
        cold = chain_job([rng.getrandbits(63) for _ in range(len(chain))])
        t0 = clock()
        cands = dispatcher.hash(cold, dispatcher.candidates())
        dispatcher.choose(cold, cands, dispatcher.look_up(cands))
        miss.append(clock() - t0)
    return {
        "benchmark": "Dispatcher routing steps, thread CPU per request",
        "checkout": os.getcwd(),
        "workers": workers,
        "blocks_per_worker": blocks,
        "requests": requests,
        "route_hit_p50_ms": _pct(hit, 0.5),
        "route_hit_p99_ms": _pct(hit, 0.99),
        "route_miss_p50_ms": _pct(miss, 0.5),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_dispatch", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--blocks", type=int, default=2000, help="blocks per worker")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument(
        "--checkout", type=Path, default=None, help="time the build checked out in this directory"
    )
    args = parser.parse_args(argv)
    sizes = ["--workers", str(args.workers), "--blocks", str(args.blocks)]
    if args.checkout is not None:
        cmd = [sys.executable, str(Path(__file__).resolve()), *sizes]
        return subprocess.run(
            [*cmd, "--requests", str(args.requests)], cwd=args.checkout
        ).returncode
    print(json.dumps(run(args.workers, args.blocks, args.requests)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
