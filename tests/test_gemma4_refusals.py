"""A Gemma 4 the engine cannot serve so is refused at start in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.gemma4_models import save_gemma4
from tests.integration.engine import REPO


def test_tensor_parallel_over_an_odd_kv_head_count_is_refused_in_one_line(tmp_path: Path) -> None:
    """The tiny model's global layers have 1 KV head: 2 ranks cannot split it."""
    save_gemma4(tmp_path / "model")
    endpoint = f"ipc://{tmp_path}/client.sock"
    cmd = [sys.executable, "launcher.py", "--model", str(tmp_path / "model"), "--endpoint", endpoint,
           "--tp-size", "2"]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--tp-size 2 does not divide Gemma 4's head counts [1]" in lines[0], lines
