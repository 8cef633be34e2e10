"""--kv-cache-dtype fp8_e4m3 where it cannot be served is refused at start in one line: a model with
per-head K/V, a backend other than the CPU's C kernels, activations the C latent attention does not
take (the launcher's check, from the model's config alone); the worker refuses the same from what it
built (a CUDA device under --device auto)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from launcher_checks import check_model
from launcher_flags import build_parser
from tests.integration.engine import REPO
from tests.mla_models import save_mla_model, tiny_mla_config
from tests.models import tiny_config

WHY = "--kv-cache-dtype fp8_e4m3: "


@pytest.mark.parametrize(
    ("model", "flags", "line"),
    [
        ("llama", [], "a float8 pool is latent attention's (DeepSeek-V2/V3, GLM-4.7-Flash), not per-head"),
        (
            "mla",
            ["--device-backend", "torch"],
            "only the cpu backend's C kernels read a float8 latent pool, not the torch",
        ),
        (
            "mla",
            ["--device-backend", "triton"],
            "only the cpu backend's C kernels read a float8 latent pool, not the triton",
        ),
        ("mla", ["--disable-cpu-kernels"], "only the CPU's C kernels read a float8 latent pool: off"),
        (
            "mla",
            ["--dtype", "float64"],
            "the C latent attention takes float32 or bfloat16 activations, not float64",
        ),
    ],
    ids=["per-head-kv", "torch", "triton", "no-c-kernels", "float64"],
)
def test_refused_in_one_line(tmp_path: Path, model: str, flags: list[str], line: str) -> None:
    config = tiny_mla_config("v2_lite") if model == "mla" else tiny_config("llama", False)
    config.save_pretrained(tmp_path / "model")  # the config alone decides
    endpoint = f"ipc://{tmp_path}/client.sock"
    cmd = [sys.executable, "launcher.py", "--model", str(tmp_path / "model"), "--endpoint", endpoint,
           "--kv-cache-dtype", "fp8_e4m3", *flags]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and WHY + line in lines[0], lines


def test_worker_refuses_what_it_built(tmp_path: Path) -> None:
    """The worker's own check, on the backend it got (the launcher cannot tell a CUDA device under
    --device auto): ValueError naming why, before any pool is allocated."""
    save_mla_model("v2_lite", tmp_path)
    config = WorkerConfig(model_path=str(tmp_path), dtype="float32", kv_cache_tokens=64, num_threads=1,
                          kv_cache_dtype="fp8_e4m3", device_backend="torch")  # fmt: skip
    with pytest.raises(ValueError, match=WHY + "only the cpu backend's C kernels .* not the torch backend"):
        ModelRunner(config)


def test_latent_model_on_the_cpu_backend_passes(tmp_path: Path) -> None:
    """The launcher's check lets the served case through: a latent model, the cpu backend (auto on a
    CPU), its C kernels, float32 or bfloat16 activations."""
    tiny_mla_config("v2_lite").save_pretrained(tmp_path)
    for flags in ([], ["--device-backend", "cpu", "--dtype", "bfloat16"], ["--device", "cpu"]):
        args = build_parser().parse_args(["--model", str(tmp_path), "--kv-cache-dtype", "fp8_e4m3", *flags])
        check_model(args, tmp_path)
