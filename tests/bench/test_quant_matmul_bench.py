"""bench/quant_matmul.py --against: another build's paths on the same weights, interleaved (no timing
assertions)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_worker.backends.cpu import kernels as cpu_kernels
from tests.conftest import ACTING_KIND

ROOT = Path(__file__).resolve().parents[2]


def test_against_runs_the_other_build_beside_this_one() -> None:
    built = cpu_kernels.load(ACTING_KIND)
    if built is None:
        pytest.skip("the C kernels do not build here")
    cmd = [sys.executable, "-m", "bench.quant_matmul", "--against", str(built.path), "--types", "q4_0,q4_k",
           "--rows", "1,3", "--shapes", "16x256", "--layers", "1", "--repeats", "1", "--no-head",
           "--paths", "q4_0|q4_k"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    header = next(line for line in done.stdout.splitlines() if line.startswith("| rows |"))
    assert header == "| rows | q4_0 ms | q4_k ms | q4_0@against ms | q4_k@against ms |"
    for name in ("q4_0", "q4_k"):
        line = rf"^{name}: this build / --against: 1 rows ([\d.]+), 3 rows ([\d.]+)$"
        ratios = re.search(line, done.stdout, re.M)
        assert ratios is not None, done.stdout
        assert all(float(r) > 0 for r in ratios.groups())
