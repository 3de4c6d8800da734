"""kvroute against other cache-aware routers, on the same worker fleet and the same workload.

Routers compared, each on a fresh fleet (private Redis + ``--workers`` workers)
so every run starts from cold caches:

- ``kvroute`` and ``round_robin``: kvroute's own gateway with that policy;
- ``sglang``: sglang-router (``smg launch --policy cache_aware``) and
- ``vllm``: vllm-router (``vllm-router --policy cache_aware``), both Rust
  binaries from PyPI wheels, in front of the workers' OpenAI HTTP front.

The peers live in their own virtual environment (``--peers-venv``, default
``.venv-peers``), created on first use with ``pip install --no-deps
sglang-router vllm-router`` plus the few packages their launchers import
(wheels are taken from ``--wheel-dir`` when it holds them). sglang-router gets
``--model-path`` = the local model folder so it never reaches for a hub.

Hit rate comes from the workers' own ``/metrics`` counters (before/after
deltas), so every router is measured the same way. One JSON object goes to
stdout; a router that cannot run is reported with the exact reason under
``routers.<name>.error`` and the others still run.

Usage: ``python -m loadtest.bench_peers [--users 4 --turns 3 --routers kvroute,round_robin,
sglang,vllm --json]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadtest.bench_fleet import (
    FleetBenchConfig,
    add_fleet_flags,
    fleet_config,
    fleet_config_from_args,
    measure,
    run_policy,
    torch_threads,
)
from loadtest.client import RequestResult
from loadtest.fleet import Fleet, free_port, sigterm_as_ctrl_c
from loadtest.fleet_summary import jsonable
from loadtest.mooncake_trace import TRACE_ARRIVALS

logger = logging.getLogger(__name__)

ROUTERS = ("kvroute", "round_robin", "sglang", "vllm")
# With --engine emulated (loadtest.peers_matrix): kvroute's variants named as in the issue.
EMULATED_ROUTERS = ("kvroute", "kvroute_3_replicas", "kvroute_round_robin", "sglang", "vllm")
# On request only: the fleet's gateway as two processes on one port (``--processes 2``).
EXTRA_ROUTERS = ("kvroute_2_processes",)
PEER_PACKAGES = ("sglang-router", "vllm-router")
PEER_DEPS = ("setproctitle", "aiohttp", "orjson", "uvicorn", "fastapi", "requests")
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class PeersConfig:
    """Which routers, where the peers' venv lives, and how long a router may take to start."""

    routers: tuple[str, ...] = ROUTERS
    peers_venv: str = ".venv-peers"
    wheel_dir: str = ""  # "" = install the peers from PyPI
    router_startup_s: float = 60.0
    # Which comparison the names are for: each knows its own (``round_robin`` given to
    # the emulated one ran kvroute's own policy under that name).
    emulated: bool = False

    def __post_init__(self) -> None:
        known = (*EMULATED_ROUTERS, *EXTRA_ROUTERS) if self.emulated else ROUTERS
        unknown = [r for r in self.routers if r not in known]
        if unknown or not self.routers:
            raise ValueError(f"--routers {','.join(self.routers)!r}: choose from {known}")


class PeerUnavailable(RuntimeError):
    """A peer router could not be installed or started; the message says exactly why."""


# -- the peers' virtual environment ----------------------------------------------------------------


def _run(cmd: Sequence[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise PeerUnavailable(f"{what} failed ({proc.returncode}): {' | '.join(tail)}")


def ensure_peer_venv(pcfg: PeersConfig) -> Path:
    """The peers' venv ``bin/`` folder, created and filled on first use."""
    venv = Path(pcfg.peers_venv)
    if not venv.is_absolute():
        venv = ROOT / venv
    bin_dir = venv / "bin"
    if (bin_dir / "smg").exists() and (bin_dir / "vllm-router").exists():
        return bin_dir
    if not (bin_dir / "python").exists():
        _run([sys.executable, "-m", "venv", str(venv)], f"python -m venv {venv}")
    pip = [str(bin_dir / "python"), "-m", "pip", "install", "--quiet"]
    wheels = sorted(Path(pcfg.wheel_dir).glob("*router*.whl")) if pcfg.wheel_dir else []
    names = {w.name.split("-")[0].replace("_", "-") for w in wheels}
    sources = [str(w) for w in wheels] + [p for p in PEER_PACKAGES if p not in names]
    _run([*pip, "--no-deps", *sources], "pip install --no-deps " + " ".join(sources))
    _run([*pip, *PEER_DEPS], "pip install " + " ".join(PEER_DEPS))
    for binary in ("smg", "vllm-router"):
        if not (bin_dir / binary).exists():
            raise PeerUnavailable(f"{bin_dir / binary} missing after installing {PEER_PACKAGES}")
    return bin_dir


def router_command(
    name: str, bin_dir: Path, port: int, worker_urls: Sequence[str], model_dir: str
) -> list[str]:
    """The command line that starts peer ``name`` on ``port`` in front of ``worker_urls``."""
    if name == "sglang":
        # --model-path: a local folder, so smg loads its tokenizer from disk, not a hub.
        return [
            str(bin_dir / "smg"),
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *worker_urls,
            "--policy",
            "cache_aware",
            "--model-path",
            model_dir,
            "--log-level",
            "warn",
            # Not the fixed default 29000: another router on this host may hold it.
            "--prometheus-port",
            str(free_port()),
        ]
    if name == "vllm":
        return [
            str(bin_dir / "vllm-router"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *worker_urls,
            "--policy",
            "cache_aware",
            "--log-level",
            "warning",
            "--prometheus-port",
            str(free_port()),
        ]
    raise ValueError(f"--routers: {name!r} is not a peer router")


def _wait_healthy(proc: subprocess.Popen[bytes], port: int, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-5:]
            raise PeerUnavailable(f"exited with {proc.returncode}: {' | '.join(tail)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:
            logger.debug("router on %d not ready: %s", port, exc)
        time.sleep(0.5)
    raise PeerUnavailable(f"no 200 on /health within {timeout:.0f}s (log {log})")


def with_peer(
    cfg: FleetBenchConfig,
    pcfg: PeersConfig,
    name: str,
    fleet: Fleet,
    log_dir: Path,
    measure_through: Callable[[str], dict[str, Any]],
) -> dict[str, Any]:
    """Starts peer ``name`` in front of ``fleet``'s workers, measures through it, stops it."""
    bin_dir = ensure_peer_venv(pcfg)
    t_start = time.perf_counter()
    urls = [w.http_url for w in fleet.workers]
    port = free_port()
    cmd = router_command(name, bin_dir, port, urls, fleet.model_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}-router.log"
    with open(log, "ab") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(proc, port, pcfg.router_startup_s, log)
        out: dict[str, Any] = {"policy": "cache_aware", "command": " ".join(cmd)}
        out["startup_s"] = time.perf_counter() - t_start
        out.update(measure_through(f"http://127.0.0.1:{port}"))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    return out


def run_peer(
    cfg: FleetBenchConfig,
    pcfg: PeersConfig,
    name: str,
    log_dir: Path,
    on_result: Callable[[RequestResult], None] | None = None,
) -> dict[str, Any]:
    """A fresh fleet, peer ``name`` started in front of its workers, measured through the peer."""
    # The fleet's own gateway is started too but gets no traffic.
    with torch_threads(cfg.worker_threads), Fleet(fleet_config(cfg, "round_robin", name)) as fleet:
        urls = [w.http_url for w in fleet.workers]
        return with_peer(
            cfg, pcfg, name, fleet, log_dir, lambda url: measure(cfg, url, urls, on_result)
        )


def side_by_side(routers: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per router with the headline numbers (hit rate from the workers' counters)."""
    rows = []
    for name, r in routers.items():
        if "error" in r:
            rows.append({"router": name, "error": r["error"]})
            continue
        rows.append(
            {
                "router": name,
                "hit_rate": r["worker_metrics"]["hit_rate"],
                "hit_rate_turn_ge_3": r["late_turns"]["hit_rate"],
                "ttft_p50_s": r["ttft_p50_s"],
                "ttft_p99_s": r["ttft_p99_s"],
                "throughput_rps": r["throughput_rps"],
                "output_tokens_per_s": r["output_tokens_per_s"],
                "prompt_share": sorted(r["worker_metrics"]["prompt_share"].values()),
                "errors": sum(r["errors"].values()),
            }
        )
    return rows


def run(cfg: FleetBenchConfig, pcfg: PeersConfig, *, progress: bool = False) -> dict[str, Any]:
    """Every router in turn on a fresh fleet, same seed; the JSON-ready result."""
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.users * cfg.turns * len(pcfg.routers), unit="req", file=sys.stderr)
    tick = (lambda _r: bar.update()) if bar is not None else None
    log_dir = Path(cfg.log_dir or "/tmp/kvroute-bench-peers")
    routers: dict[str, dict[str, Any]] = {}
    try:
        for name in pcfg.routers:
            if bar is not None:
                bar.set_description(name)
            try:
                if name in ("kvroute", "round_robin"):
                    routers[name] = run_policy(cfg, name, tick)
                else:
                    routers[name] = run_peer(cfg, pcfg, name, log_dir, tick)
            except (PeerUnavailable, OSError, subprocess.SubprocessError) as exc:
                logger.warning("%s could not run: %s", name, exc)
                routers[name] = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        if bar is not None:
            bar.close()
    return {
        "config": asdict(cfg),
        "peers": asdict(pcfg),
        "table": side_by_side(routers),
        "routers": routers,
    }


def main(argv: Sequence[str] | None = None) -> int:
    # Four routers, each on a fresh fleet: 4 users x 3 turns keep the run near ten minutes here.
    d, dp = FleetBenchConfig(users=4, turns=3), PeersConfig()
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench_peers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--routers", default=",".join(dp.routers), help="comma-separated")
    add_fleet_flags(p, d)
    p.add_argument("--peers-venv", default=dp.peers_venv)
    p.add_argument(
        "--wheel-dir",
        default=dp.wheel_dir,
        help="folder of local peer wheels (default: none, install from PyPI)",
    )
    p.add_argument("--log-dir", default="", help="process logs (default /tmp/kvroute-bench-peers)")
    p.add_argument("--json", action="store_true", help="compact JSON (default: indented)")
    p.add_argument("--no-progress", action="store_true")
    add_matrix_flags(p)
    args = p.parse_args(argv)
    if args.engine == "emulated":
        with sigterm_as_ctrl_c():
            return main_emulated(args, argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = fleet_config_from_args(args, from_turn=min(3, args.turns))
        cfg.chat()
        pcfg = PeersConfig(
            routers=tuple(r.strip() for r in args.routers.split(",") if r.strip()),
            peers_venv=args.peers_venv,
            wheel_dir=args.wheel_dir,
        )
    except ValueError as exc:
        print(f"bench_peers: {exc}", file=sys.stderr)
        return 2
    with sigterm_as_ctrl_c():
        result = run(cfg, pcfg, progress=not args.no_progress)
    print(json.dumps(jsonable(result), indent=None if args.json else 2, default=str))
    return 0 if all("error" not in r for r in result["routers"].values()) else 1


def add_matrix_flags(p: argparse.ArgumentParser) -> None:
    """Flags of the ``--engine emulated`` comparison (``loadtest.peers_matrix``)."""
    from loadtest.peers_matrix import MatrixConfig

    d = MatrixConfig()
    g = p.add_argument_group("--engine emulated: routers x workloads (loadtest.peers_matrix)")
    g.add_argument("--workloads", default=",".join(d.workloads), help="comma-separated")
    g.add_argument("--trace-limit", type=int, default=d.trace_limit)
    g.add_argument("--trace-block-tokens", type=int, default=d.trace_block_tokens)
    g.add_argument("--trace-speedup", type=float, default=d.trace_speedup)
    g.add_argument(
        "--trace-arrivals",
        choices=TRACE_ARRIVALS,
        default=d.trace_arrivals,
        help="the Mooncake replay's arrivals: as recorded (about ten requests at each 3 s "
        "instant) or spread evenly over each instant's 3 s",
    )
    g.add_argument("--plot-dir", default="", help="write one PNG per workload here")
    g.add_argument(
        "--rounds",
        type=int,
        default=d.rounds,
        help="run every router this many times, alternating their order; report medians",
    )


def main_emulated(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``--engine emulated``: every router x workload on fresh emulated fleets; one JSON object."""
    from loadtest import peers_matrix

    routers = args.routers
    if routers == ",".join(ROUTERS):  # the default: the emulated comparison's router names
        routers = ",".join(EMULATED_ROUTERS)
    try:
        cfg = fleet_config_from_args(args, from_turn=1)
        pcfg = PeersConfig(
            routers=tuple(r.strip() for r in routers.split(",") if r.strip()),
            peers_venv=args.peers_venv,
            wheel_dir=args.wheel_dir,
            emulated=True,
        )
        mcfg = peers_matrix.matrix_config(args)
    except ValueError as exc:
        print(f"bench_peers: {exc}", file=sys.stderr)
        return 2
    shown = sys.argv[1:] if argv is None else list(argv)
    command = "python -m loadtest.bench_peers " + " ".join(shown)
    result = peers_matrix.run(cfg, pcfg, mcfg, command)
    if args.plot_dir:
        from loadtest.plots import plot_router_matrix

        result["plots"] = plot_router_matrix(result["workloads"], args.plot_dir)
    print(json.dumps(jsonable(result), indent=None if args.json else 2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
