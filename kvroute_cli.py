"""The ``kvroute`` command: one entry point, a subcommand per component.

    kvroute gateway --help   the OpenAI-compatible, cache-aware gateway
    kvroute worker --help    a paged-KV prefix-caching inference worker
    kvroute bridge --help    a vLLM worker in the fleet, from vLLM's KV events
    kvroute up --help        a local fleet (Redis, workers, gateway) in one command

Each subcommand's module is imported only when chosen, so ``kvroute gateway``
never imports torch.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "gateway": ("gateway.cli", "the OpenAI-compatible, cache-aware routing gateway"),
    "worker": ("worker.serve.cli", "a paged-KV prefix-caching inference worker"),
    "bridge": ("worker.bridge.cli", "joins a vLLM worker to the fleet from vLLM's own KV events"),
    "up": ("loadtest.up", "a local fleet: Redis, N workers and the gateway"),
}


def _usage() -> str:
    lines = ["usage: kvroute {" + ",".join(SUBCOMMANDS) + "} [options]", "", "subcommands:"]
    lines += [f"  {name:<9} {desc}" for name, (_, desc) in SUBCOMMANDS.items()]
    lines.append("\nrun `kvroute SUBCOMMAND --help` for its options")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"kvroute: unknown subcommand {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
