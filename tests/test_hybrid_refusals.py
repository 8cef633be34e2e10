"""What the engine cannot do with a hybrid model (Qwen3.5, Qwen3-Next) is refused at start in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.hybrid_models import tiny_hybrid_config
from tests.integration.engine import REPO


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (
            ["--speculative-algorithm", "ngram"],
            "--speculative-algorithm ngram: qwen3_5's linear-attention layers",
        ),
        (["--tp-size", "2"], "--tp-size 2: qwen3_5's linear-attention layers (Gated DeltaNet) do not split"),
    ],
    ids=["ngram", "tp"],
)
def test_refused_in_one_line(tmp_path: Path, flags: list[str], line: str) -> None:
    tiny_hybrid_config("qwen3_5").save_pretrained(tmp_path / "model")  # the config alone decides
    endpoint = f"ipc://{tmp_path}/client.sock"
    cmd = [sys.executable, "launcher.py", "--model", str(tmp_path / "model"), "--endpoint", endpoint, *flags]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and line in lines[0], lines
