"""Start the real launcher as a subprocess on a temp endpoint, and always tear it down."""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 240.0


@dataclass
class RunningEngine:
    proc: subprocess.Popen[str]
    endpoint: str
    child_pids: dict[str, int]
    log_path: Path
    ready_line: str = ""  # "rivulet ready: endpoint=... [http=http://HOST:PORT] pids: ..."

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> dict[str, int]:
        """Wait for the Ready line; its children's pids by name (gpu_worker.1: replica 1's)."""
        line = self.ready_line = _read_ready_line(self.proc, READY_TIMEOUT_S)
        pairs = re.findall(r"([\w.]+)=(\d+)", line.split("pids:", 1)[1])
        self.child_pids.update({name: int(pid) for name, pid in pairs})
        return self.child_pids


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until every pid is gone; return the ones still alive at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if pid_alive(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


def _read_ready_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not sel.select(timeout=0.5):
            if proc.poll() is not None:
                raise RuntimeError(f"launcher exited with {proc.returncode} before Ready")
            continue
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"launcher exited with {proc.returncode} before Ready")
        if line.startswith("rivulet ready:"):
            return line
    raise TimeoutError("launcher did not print Ready in time")


@contextlib.contextmanager
def launched(model: Path | None, tmp_path: Path, *args: str) -> Iterator[RunningEngine]:
    """``python launcher.py [--model MODEL] --endpoint ipc://TMP ... ARGS`` started, not yet ready
    (``wait_ready``), logging to TMP/launcher.log; stopped and reaped on exit."""
    endpoint = f"ipc://{tmp_path}/client.sock"
    log_path = tmp_path / "launcher.log"
    model_args = ["--model", str(model)] if model is not None else []
    cmd = [sys.executable, "launcher.py", *model_args, "--endpoint", endpoint, "--num-threads", "1", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    engine = RunningEngine(proc, endpoint, {}, log_path)
    try:
        yield engine
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for pid in wait_gone(list(engine.child_pids.values()), 5.0):  # never leave one behind
            os.kill(pid, signal.SIGKILL)
        if proc.stdout is not None:
            proc.stdout.close()


@contextlib.contextmanager
def running_engine(model: Path | None, tmp_path: Path, *args: str) -> Iterator[RunningEngine]:
    """``launched`` once ready. ``model=None`` runs the embedded default model, as a user's first
    start does."""
    with launched(model, tmp_path, *args) as engine:
        engine.wait_ready()
        yield engine
