"""The log of one child process of a local fleet: to a file, to the terminal, and a tail.

A thread reads the child's combined stdout/stderr line by line and sends each
line to up to three places: the file ``<log_dir>/<name>.log``, the parent's
stderr with a ``name | `` prefix (``kvroute up`` streams every child that way),
and an in-memory tail of the last lines, so an error about a child that died
can quote what it said before it died.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from pathlib import Path
from typing import IO, TextIO


class ChildLog:
    """Pumps one child's output; ``tail()`` is its last lines, ``join()`` waits for EOF."""

    def __init__(
        self,
        name: str,
        stream: IO[bytes],
        path: Path | None = None,
        echo: TextIO | None = None,
        tail_lines: int = 30,
        width: int = 9,
        watch: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        # Phrases remembered once seen (case-insensitive): a cause can scroll out of the tail.
        self._watch = tuple(phrase.lower() for phrase in watch)
        self._seen: set[str] = set()
        self.path = path
        self._stream = stream
        self._echo = echo
        self._prefix = f"{name:<{width}} | "
        self._tail: deque[str] = deque(maxlen=tail_lines)
        self._file = path.open("w", encoding="utf-8") if path is not None else None
        self._thread = threading.Thread(target=self._pump, name=f"log-{name}", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            for raw in iter(self._stream.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                self._tail.append(line)
                if self._watch:
                    lowered = line.lower()
                    self._seen.update(p for p in self._watch if p in lowered)
                if self._file is not None:
                    self._file.write(line + "\n")
                    self._file.flush()
                if self._echo is not None:
                    self._echo.write(self._prefix + line + "\n")
                    self._echo.flush()
        except (OSError, ValueError):
            # The pipe closed under us while stopping: nothing left to read.
            return
        finally:
            if self._file is not None:
                self._file.close()

    def saw(self, phrase: str) -> bool:
        """Whether a line so far contained ``phrase``, one of those given as ``watch``."""
        return phrase.lower() in self._seen

    def tail(self, lines: int = 12) -> str:
        """The child's last ``lines`` lines, indented, for an error message."""
        kept = list(self._tail)[-lines:]
        return "\n".join("    " + line for line in kept) if kept else "    (no output)"

    def join(self, timeout: float = 2.0) -> None:
        self._thread.join(timeout)


def echo_target(enabled: bool) -> TextIO | None:
    """Where streamed lines go: the parent's stderr, or nowhere."""
    return sys.stderr if enabled else None
