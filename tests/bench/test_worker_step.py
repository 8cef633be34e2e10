"""bench.worker_step's --toggle: a kernels-library switch set to 0 and 1 on alternate steps."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_toggle_times_both_settings_and_restores_the_switch(tiny_llama_dir: Path) -> None:
    argv = [sys.executable, "-m", "bench.worker_step", "--model", str(tiny_llama_dir), "--dtype", "float32",
            "--decode-batches", "1,2", "--prefill", "0", "--context", "8", "--iters", "4", "--warmup", "1",
            "--toggle", "weight_prefetch_nta"]  # fmt: skip
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=280, check=True).stdout
    num = r"([\d.]+)"
    pattern = rf"^(decode\d+) +weight_prefetch_nta=0 +{num} +weight_prefetch_nta=1 +{num} +1 / 0 {num}$"
    lines = {m.group(1): m for m in re.finditer(pattern, out, re.M)}
    assert set(lines) == {"decode1", "decode2"}, out
    for m in lines.values():
        off, on, ratio = (float(m.group(i)) for i in (2, 3, 4))
        # each printed to 0.01 ms: the ratio of the printed values within that rounding of both
        slack = 0.005 * (1 + on / off) / off + 1e-3
        assert off > 0 and on > 0 and ratio == pytest.approx(on / off, abs=slack)


def test_toggle_of_a_name_the_library_lacks_fails(tiny_llama_dir: Path) -> None:
    argv = [sys.executable, "-m", "bench.worker_step", "--model", str(tiny_llama_dir), "--dtype", "float32",
            "--decode-batches", "1", "--prefill", "0", "--iters", "1",
            "--toggle", "no_such_switch"]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode != 0 and "no_such_switch" in done.stderr


def test_one_call_toggle_of_a_model_without_it_fails(tiny_llama_dir: Path) -> None:
    """--toggle one_call names the one-call decode; a float32 HF model (no GGUF blocks) has none."""
    argv = [sys.executable, "-m", "bench.worker_step", "--model", str(tiny_llama_dir), "--dtype", "float32",
            "--decode-batches", "1", "--prefill", "0", "--iters", "1", "--toggle", "one_call"]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode != 0 and "has no one-call decode" in done.stderr
