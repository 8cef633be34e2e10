"""A gpt-oss the engine cannot serve so is refused at start in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.exactness.test_gpt_oss import hf_gpt_oss, tiny_gpt_oss_config
from tests.integration.engine import REPO


def test_tensor_parallel_is_refused_in_one_line(tmp_path: Path) -> None:
    hf_gpt_oss(tiny_gpt_oss_config(layers=2)).save_pretrained(tmp_path / "model", safe_serialization=True)
    endpoint = f"ipc://{tmp_path}/client.sock"
    cmd = [sys.executable, "launcher.py", "--model", str(tmp_path / "model"), "--endpoint", endpoint,
           "--tp-size", "2"]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--tp-size 2: gpt-oss's attention sinks" in lines[0], lines
