"""Every command block of the README and docs/ runs, or is parsed, so the docs cannot rot silently.

A ```bash block's commands are read as the shell would split them. What each kind of command gets:

- ``python launcher.py ...`` starts the engine: its flags are parsed by the launcher's parser, and
  every such block not marked parse-only runs, all of them as ONE engine started with the union of
  their flags (they must agree) on a temp endpoint and a free HTTP port;
- ``python -m client ...``, ``python -c ...`` and ```python blocks are requests: run against that
  engine (the default endpoint and port 8000 replaced by the engine's);
- ``python -m bench.X ...`` (the one way a bench script runs): parsed by that module's own argparse parser;
  run against the engine with the tiny settings of the block's marker
  ``<!-- docs-test: smoke ARGS -->`` (ARGS appended), or only parsed under
  ``<!-- docs-test: parse-only (why) -->``; an unmarked bench block is an error;
- ``pip install ...`` / ``python -m pytest ...``: the README's test command must be what .ci/run runs,
  and every extra named must exist in pyproject.toml.

A marker is the line right before the block's opening fence.
"""

from __future__ import annotations

import argparse
import os
import re
import runpy
import shlex
import socket
import subprocess
import sys
import tomllib
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

import launcher_flags
from tests.integration.engine import RunningEngine, running_engine

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
DEFAULT_ENDPOINT = "ipc:///tmp/rivulet/client.sock"
DOC_HTTP = "127.0.0.1:8000"  # the port the docs' HTTP examples use
MARKER = re.compile(r"<!--\s*docs-test:\s*(parse-only|smoke)\b(.*?)-->")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
ASSIGNED = re.compile(r"^\w+=\$\(")  # VAR=$(command ...): the command is read, the variable dropped
REQUEST_TIMEOUT_S = 120


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    lang: str
    text: str
    mode: str  # "run", "parse-only" or "smoke"
    smoke_args: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def read_blocks() -> list[Block]:
    blocks = []
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = MARKER.search(before)
            mode, args = ("run", "") if marker is None else (marker.group(1), marker.group(2))
            smoke = tuple(shlex.split(args)) if mode == "smoke" else ()
            line = text.count("\n", 0, m.start()) + 1
            blocks.append(Block(str(path.relative_to(REPO)), line, m.group(1), m.group(2), mode, smoke))
    return blocks


def commands(script: str) -> Iterator[list[str]]:
    """Each simple command of a bash script: continuation lines joined, comments dropped, split at
    ``&&``, ``;`` and ``&``, leading ``VAR=value`` and ``flock LOCK`` taken off."""
    for line in script.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        cmd: list[str] = []
        for word in [*words, ";"]:
            if word not in ("&&", ";", "&"):
                cmd.append(word)
                continue
            if ASSIGNED.match(cmd[0] if cmd else ""):
                cmd = [cmd[0].split("$(", 1)[1], *cmd[1:]]
                cmd[-1] = cmd[-1].removesuffix(")") or cmd[-1]
                cmd = [w for w in cmd if w]
            while cmd and re.fullmatch(r"\w+=\S*", cmd[0]):
                cmd = cmd[1:]
            if cmd[:1] == ["flock"]:
                cmd = cmd[2:]
            if cmd:
                yield cmd
            cmd = []


def kind_of(cmd: list[str]) -> str:
    if cmd[:2] == ["python", "launcher.py"]:
        return "engine"
    if cmd[:2] == ["python", "-m"] and cmd[2].startswith("bench."):
        return "bench"
    if re.fullmatch(r"bench/.+\.py", cmd[1]):
        raise AssertionError(f"bench scripts run as python -m bench.NAME: {shlex.join(cmd)}")
    if cmd[:3] == ["python", "-m", "client"]:
        return "client"
    if cmd[:2] == ["python", "-c"]:
        return "python-c"
    if cmd[:2] == ["pip", "install"] or cmd[:3] == ["python", "-m", "pytest"]:
        return "setup"
    raise AssertionError(f"a command the docs test does not know: {shlex.join(cmd)}")


class _Parsed(BaseException):  # not an Exception: a script's own handlers must not catch it
    def __init__(self, parser: argparse.ArgumentParser, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
        self.parser, self.args, self.kwargs = parser, args, kw


def script_args(cmd: list[str]) -> argparse.Namespace:
    """The namespace a bench or client script's own argparse parser makes of ``cmd``'s arguments:
    the script runs in this process until its first ``parse_args``, which stops it."""
    module, args = (cmd[2], cmd[3:]) if cmd[1] == "-m" else (None, cmd[2:])
    with _stopped_at_parse_args([module or cmd[1], *args]) as parsing:
        try:
            _run_script(module, cmd[1])
            raise AssertionError(f"{shlex.join(cmd)}: the script never parsed its arguments")
        except _Parsed as parsed:
            stopped = parsed
        except SystemExit as exc:
            raise AssertionError(f"{shlex.join(cmd)}: it exited before parsing ({exc})") from None
        try:
            return parsing(stopped)
        except SystemExit as exc:
            raise AssertionError(f"{shlex.join(cmd)}: its parser refused the arguments ({exc})") from None


def script_parser(module: str) -> argparse.ArgumentParser:
    """The parser ``python -m module`` parses its command line with (nothing parsed)."""
    with _stopped_at_parse_args([module]):
        try:
            _run_script(module, "")
        except _Parsed as parsed:
            return parsed.parser
    raise AssertionError(f"python -m {module}: the script never parsed its arguments")


@contextmanager
def _stopped_at_parse_args(argv: list[str]) -> Iterator[Callable[[_Parsed], argparse.Namespace]]:
    """While inside, a script's first ``parse_args`` raises _Parsed instead of parsing; the value
    yielded parses what was stopped, with the real parser, under the same ``sys.argv``."""
    real = argparse.ArgumentParser.parse_args

    def capture(self: argparse.ArgumentParser, *a: Any, **kw: Any) -> Any:
        raise _Parsed(self, a, kw)

    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", capture),
        mock.patch.object(sys, "argv", argv),
    ):
        yield lambda parsed: real(parsed.parser, *parsed.args, **parsed.kwargs)


def _run_script(module: str | None, path: str) -> None:
    warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)  # runpy's, harmless
    if module:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(str(REPO / path), run_name="__main__")


def engine_args(cmd: list[str]) -> argparse.Namespace:
    try:
        return launcher_flags.build_parser().parse_args(cmd[2:])
    except SystemExit:
        raise AssertionError(f"{shlex.join(cmd)}: the launcher's parser refused it") from None


def check_parses(cmd: list[str]) -> None:
    match kind_of(cmd):
        case "engine":
            engine_args(cmd)
        case "bench" | "client":
            script_args(cmd)
        case "python-c":
            compile(cmd[2], "<python -c>", "exec")
        case "setup":
            project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
            extras = set(project["optional-dependencies"])
            for word in cmd:
                named = re.fullmatch(r"\.\[([\w,]+)\]", word)
                assert named is None or set(named.group(1).split(",")) <= extras, f"no such extra: {word}"


BLOCKS = read_blocks()
BASH = [b for b in BLOCKS if b.lang == "bash"]


# ---------------------------------------------------------------- every block parses


@pytest.mark.parametrize("block", BASH, ids=lambda b: b.where)
def test_every_command_parses(block: Block) -> None:
    cmds = list(commands(block.text))
    assert cmds, f"{block.where}: a bash block with no command"
    for cmd in cmds:
        check_parses(cmd)
    if any(kind_of(c) == "bench" for c in cmds) and block.mode == "run":
        raise AssertionError(
            f"{block.where}: a bench block needs <!-- docs-test: smoke ARGS --> or parse-only"
        )


def test_the_readme_test_command_is_what_ci_runs() -> None:
    def normal(cmd: list[str]) -> list[str]:
        cmd = cmd[2:] if cmd[:3] == ["python", "-m", "pip"] else cmd
        cmd = ["pip", *cmd[1:]] if cmd[:1] == ["pip"] else cmd
        return [w for w in cmd if w != "-q"]

    readme = [b for b in BASH if b.doc == "README.md" and "pytest" in b.text]
    assert len(readme) == 1, "the README has one test command"
    ci = [normal(c) for c in commands((REPO / ".ci/run").read_text()) if c[0] not in ("set", "cd", "export")]
    wanted = [normal(c) for c in commands(readme[0].text)]
    ci_runs = [c for c in ci if c[:1] == ["pip"] or "pytest" in c]
    assert ci_runs == wanted, f".ci/run runs {ci_runs}, the README says {wanted}"


# ---------------------------------------------------------------- the runnable blocks run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def merged_engine_flags() -> list[str]:
    """The runnable engine blocks' flags, all together (--http-port and --endpoint aside); two blocks
    that set one option differently are an error."""
    defaults = vars(launcher_flags.build_parser().parse_args([]))
    chosen: dict[str, tuple[Any, str]] = {}
    argv: list[str] = []
    for block in BASH:
        for cmd in commands(block.text) if block.mode == "run" else ():
            if kind_of(cmd) != "engine":
                continue
            for dest, value in vars(engine_args(cmd)).items():
                if value != defaults[dest] and dest not in ("http_port", "endpoint"):
                    seen = chosen.setdefault(dest, (value, block.where))
                    assert seen[0] == value, f"{block.where} and {seen[1]} set {dest} differently"
            argv += cmd[2:]
    return _dedupe(argv)


def _dedupe(argv: list[str]) -> list[str]:
    """``argv`` without repeated ``--flag value`` pairs, --http-port and --endpoint dropped."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        pair = argv[i : i + 2] if takes_value else argv[i : i + 1]
        if pair[0] not in ("--http-port", "--endpoint") and not _contains(out, pair):
            out += pair
        i += len(pair)
    return out


def _contains(argv: list[str], pair: list[str]) -> bool:
    return any(argv[j : j + len(pair)] == pair for j in range(len(argv)))


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningEngine, int]]:
    port = free_port()
    flags = merged_engine_flags()
    assert "--chunked-prefill-size" in flags, "the README's first command is among the runnable blocks"
    with running_engine(None, tmp_path_factory.mktemp("docs"), *flags, "--http-port", str(port)) as eng:
        yield eng, port


def _run(argv: list[str], eng: RunningEngine, port: int, where: str) -> str:
    argv = [a.replace(DOC_HTTP, f"127.0.0.1:{port}").replace(DEFAULT_ENDPOINT, eng.endpoint) for a in argv]
    env = {**os.environ, "RIVULET_ENDPOINT": eng.endpoint, "PYTHONPATH": str(REPO)}
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=REQUEST_TIMEOUT_S)
    output = f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert done.returncode == 0, f"{where}: {shlex.join(argv)} failed:\n{output}"
    return done.stdout


def test_runnable_blocks_run_against_one_engine(engine: tuple[RunningEngine, int]) -> None:
    eng, port = engine
    ran = 0
    for block in BLOCKS:
        if block.mode == "parse-only":
            continue
        if block.lang == "python":
            if DEFAULT_ENDPOINT in block.text or DOC_HTTP in block.text:
                assert _run([sys.executable, "-c", block.text], eng, port, block.where).strip(), block.where
                ran += 1
            continue
        if block.lang != "bash":
            continue
        for cmd in commands(block.text):
            match kind_of(cmd):
                case "client":
                    argv = [sys.executable, *cmd[1:3], "--endpoint", eng.endpoint, *cmd[3:]]
                    assert _run(argv, eng, port, block.where).strip(), f"{block.where}: no answer"
                case "python-c":
                    assert _run([sys.executable, *cmd[1:]], eng, port, block.where).strip(), block.where
                case "bench":
                    _run([sys.executable, *cmd[1:], *block.smoke_args], eng, port, block.where)
                case _:
                    continue
            ran += 1
    assert ran >= 5, f"only {ran} commands ran: the README's requests and the bench smoke runs are expected"
