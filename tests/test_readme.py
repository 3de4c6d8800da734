"""Every command the README and the results log (docs/RESULTS.md) offer runs as written.

Each ```sh block in those files is marked: ``<!-- runnable -->`` (a user can paste it on a
fresh clone) or ``<!-- runnable cheap -->`` (and this test runs it, each command within
a couple of minutes). For the runnable commands this test checks what it can without
starting a fleet: make targets dry-run, every flag of a kvroute / python -m command is in
that command's ``--help``, curl goes to loopback with a model name the gateway serves,
files named exist. The cheap ones it runs for real.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCUMENTS = (README, ROOT / "docs" / "RESULTS.md")
MARKER = re.compile(r"^<!-- runnable( cheap)? -->$")


@dataclass(frozen=True)
class Command:
    line: int
    text: str
    cheap: bool
    file: str = "README.md"


def readme_commands(path: Path = README) -> list[Command]:
    """The commands of every marked ```sh block; unmarked blocks fail the test."""
    name = str(path.relative_to(ROOT))
    lines = path.read_text().splitlines()
    out: list[Command] = []
    for i, line in enumerate(lines):
        if line.strip() != "```sh":
            continue
        marker = MARKER.match(lines[i - 1].strip()) if i else None
        assert marker, f"{name}:{i + 1}: a ```sh block without <!-- runnable --> above it"
        j, pending = i + 1, ""
        while lines[j].strip() != "```":
            text = lines[j].split("  # ")[0].rstrip() if "  # " in lines[j] else lines[j]
            pending = f"{pending} {text.strip()}".strip()
            if pending.endswith("\\"):
                pending = pending[:-1].rstrip()
            elif pending:
                out.append(Command(j + 1, pending, bool(marker.group(1)), name))
                pending = ""
            j += 1
    return out


@functools.cache
def _help(argv: tuple[str, ...]) -> str:
    proc = subprocess.run(
        [*argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def check(cmd: Command) -> None:
    """What can be checked of a command without running it."""
    words = shlex.split(cmd.text)
    where = f"{cmd.file}:{cmd.line}: {cmd.text}"
    while re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        words = words[1:]  # VAR=value prefixes
    head = words[0]
    if head == "make":
        proc = subprocess.run(
            ["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True, check=False
        )
        assert proc.returncode == 0, f"{where}\n{proc.stderr}"
    elif head in (".venv/bin/kvroute", ".venv/bin/python"):
        assert (ROOT / head).exists(), where
        if head.endswith("kvroute"):
            prefix = words[:2]
        else:
            assert words[1] == "-m", where
            prefix = words[:3]
            assert (ROOT / (words[2].replace(".", "/") + ".py")).is_file(), where
        text = _help(tuple(prefix))
        for flag in (w.split("=")[0] for w in words if w.startswith("--")):
            assert flag in text, f"{where}: {flag} is not in `{' '.join(prefix)} --help`"
        for word in words:
            if word.startswith(("loadtest/", "docs/", "deploy/")):
                assert (ROOT / word).exists(), f"{where}: no file {word}"
    elif head == "bash":
        assert (ROOT / words[1]).is_file(), where
    elif head.startswith(".venv-vllm/"):
        # Made by .ci/vllm-venv.sh (the block's first command); its flags are vLLM's.
        assert (ROOT / ".ci" / "vllm-venv.sh").is_file(), where
    elif head == "redis-server":
        assert shutil.which("redis-server"), where
    elif head == "curl":
        urls = [w for w in words if w.startswith("http")]
        assert urls and all(u.startswith("http://127.0.0.1:") for u in urls), where
        from contract.model_paths import served_model_name
        from worker.model.store import resolve_model

        body = json.loads(words[words.index("-d") + 1])
        assert body["model"] == served_model_name(str(resolve_model("smollm2"))), where
    elif head == "export":
        name, _, value = cmd.text.removeprefix("export ").partition("=")
        inner = re.fullmatch(r"\$\((.*)\)", value)
        assert inner, where
        proc = subprocess.run(
            inner.group(1), shell=True, cwd=ROOT, capture_output=True, text=True, check=False
        )
        assert proc.returncode == 0 and Path(proc.stdout.strip()).is_dir(), f"{where}: {name}"
    elif head == "git":
        # ``git worktree add DIR REV``: a baseline checkout of a commit this clone has.
        assert words[1:3] == ["worktree", "add"] and len(words) == 5, where
        shallow = subprocess.run(
            ["git", "rev-parse", "--is-shallow-repository"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        if shallow.stdout.strip() == "false":  # a shallow clone lacks the history
            proc = subprocess.run(
                ["git", "cat-file", "-e", words[4] + "^{commit}"], cwd=ROOT, check=False
            )
            assert proc.returncode == 0, f"{where}: no commit {words[4]}"
    elif head == "docker":
        assert words[1:3] == ["compose", "up"] and (ROOT / "compose.yaml").is_file(), where
    else:
        raise AssertionError(f"{where}: no check for `{head}` commands; add one")


def _commands() -> list[Command]:
    """Every document's commands; a cheap one both offer runs once, where it comes first."""
    out: list[Command] = []
    ran: set[str] = set()
    for path in DOCUMENTS:
        for cmd in readme_commands(path):
            if cmd.cheap and cmd.text in ran:
                cmd = Command(cmd.line, cmd.text, False, cmd.file)
            elif cmd.cheap:
                ran.add(cmd.text)
            out.append(cmd)
    return out


COMMANDS = _commands()


def test_readme_blocks_are_marked_and_found() -> None:
    assert len(readme_commands(README)) >= 8
    assert any(c.cheap for c in COMMANDS)
    assert not any("../shared" in c.text for c in COMMANDS)
    for path in DOCUMENTS:
        assert "../shared" not in path.read_text()


@pytest.mark.parametrize("cmd", COMMANDS, ids=[f"{c.file}:{c.line}" for c in COMMANDS])
def test_readme_command(cmd: Command) -> None:
    check(cmd)
    if cmd.cheap:
        proc = subprocess.run(
            cmd.text, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=240
        )
        assert proc.returncode == 0, f"{cmd.file}:{cmd.line}: {proc.stderr[-2000:]}"
        assert proc.stdout.strip(), f"{cmd.file}:{cmd.line}: printed nothing"


def test_checker_catches_a_wrong_flag() -> None:
    bad = Command(0, ".venv/bin/kvroute gateway --model smollm2 --no-such-flag 1", False)
    with pytest.raises(AssertionError, match="--no-such-flag"):
        check(bad)
