"""Real processes for tests: a private redis-server, free ports, waiting helpers."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, timeout: float = 30.0, host: str = "127.0.0.1") -> None:
    """Blocks until something accepts connections on ``host:port``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listened on {host}:{port} within {timeout}s")


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"):
    """Polls ``predicate`` until it returns a truthy value, which is returned."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout}s")
        time.sleep(interval)


class RedisProcess:
    """A private ``redis-server`` on a loopback port that tests may stop and restart."""

    def __init__(
        self,
        port: int | None = None,
        password: str | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found: apt-get install redis-server")
        self.binary = binary
        self.port = port or free_port()
        self.password = password
        self.extra_args = extra_args  # more redis-server options, e.g. ("--aclfile", path)
        self.dir = Path(tempfile.mkdtemp(prefix="kvroute-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisProcess:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.dir),
            "--loglevel",
            "warning",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        args += list(self.extra_args)
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port, timeout=10)
        return self

    def stop(self, kill: bool = False) -> None:
        if self.proc is None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        self.stop(kill=True)
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def env_redis_url() -> str | None:
    """``KVROUTE_TEST_REDIS_URL`` when the caller wants tests to use an existing Redis."""
    return os.environ.get("KVROUTE_TEST_REDIS_URL") or None


def fill_redis(url: str) -> list[str]:
    """Writes filler keys into the Redis at ``url`` until it refuses writes, and keeps it there.

    For a Redis started with ``--maxmemory`` and ``noeviction``. After the first
    refusal the limit is lowered a little below what is used: a refused command's
    own buffer counts against maxmemory, so otherwise the next small write may fit
    again. ``make_room(url, keys, maxmemory)`` undoes it. Returns the filler keys.
    """
    import redis

    client = redis.Redis.from_url(url)
    keys: list[str] = []
    try:
        while True:
            key = f"filler:{len(keys)}"
            try:
                client.set(key, b"x" * 10_000)
            except redis.exceptions.OutOfMemoryError:
                break
            keys.append(key)
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", max(used - 64 * 1024, 1))
    finally:
        client.close()
    return keys


def make_room(url: str, keys: list[str], maxmemory: str) -> None:
    """Restores ``maxmemory`` and deletes the filler ``fill_redis`` wrote."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.config_set("maxmemory", maxmemory)
        if keys:
            client.delete(*keys)
    finally:
        client.close()
