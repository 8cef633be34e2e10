"""A latent-attention model the engine cannot serve so is refused at start in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.integration.engine import REPO
from tests.mla_models import save_mla_model


def test_tensor_parallel_is_refused_in_one_line(tmp_path: Path) -> None:
    save_mla_model("v2_lite", tmp_path / "model")
    endpoint = f"ipc://{tmp_path}/client.sock"
    cmd = [sys.executable, "launcher.py", "--model", str(tmp_path / "model"), "--endpoint", endpoint,
           "--tp-size", "2"]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--tp-size 2: deepseek_v2's latent attention does not split" in lines[0]
