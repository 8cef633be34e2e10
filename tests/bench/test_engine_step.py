"""bench.engine_step: the engine's decode steps (scheduler core, codecs, runner) against the lone step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_engine_and_lone_steps_split_into_c_python_codecs_and_scheduler(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    argv = [sys.executable, "-m", "bench.engine_step", "--dtype", "float32", "--rows", "2",
            "--input-len", "8", "--output-len", "5", "--lone-iters", "3", "--rounds", "2", "--sections",
            "--json", str(out)]  # fmt: skip
    printed = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=280, check=True).stdout
    assert "2 rows, context 8-13" in printed, printed
    med = json.loads(out.read_text())["medians_ms"]
    for run in ("engine", "lone"):
        step, c, python = (med[f"{run}.{k}"] for k in ("step", "c", "python"))
        assert 0 < c < step and python > 0
    assert med["engine.codecs"] > 0 and med["engine.scheduler"] > 0
    assert "lone.codecs" not in med
    parts = json.loads(out.read_text())["sections_us"]
    # the whole step first; its parts below it, each a share of it
    assert next(iter(parts)) == "execute"
    assert {"_sample", "forward_decode", "check_batch", "init_forward_metadata"} <= set(parts)
    assert all(0 <= v <= parts["execute"] for v in parts.values())
