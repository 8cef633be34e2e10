"""The worker's device backends: what differs by device or CPU kind sits behind ``Backend``.

One backend is chosen once at start (``create``) from the device and ``--device-backend``:
- ``torch/``: torch's generic path on any device; the float64 reference of the exact tests.
- ``cpu/``: the CPU kinds' C kernels, weight layouts, GGUF block matmuls and thread tuning.
- ``triton/``: Triton kernels for paged attention and the K/V write (default on CUDA; on CPU
  they run under Triton's interpreter, which is how every machine tests them).

Nothing outside this package asks what device it runs on; the runner asks its backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from gpu_worker.backends.base import Backend
    from gpu_worker.config import WorkerConfig

NAMES = ("cpu", "torch", "triton")


def pick_device(name: str) -> torch.device:
    """``--device auto``: CUDA when present, else the CPU."""
    import torch  # here: the CPU-kind code beside this package is imported before torch (kind.py)

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def create(config: WorkerConfig) -> Backend:
    """The backend ``config`` asks for (``--device-backend``; auto: triton on CUDA, cpu on CPU)."""
    device = pick_device(config.device)
    name = config.device_backend
    if name == "auto":
        name = "cpu" if device.type == "cpu" else "triton"
    match name:
        case "cpu":
            if device.type != "cpu":
                raise ValueError(f"--device-backend cpu runs on the CPU, not {device}")
            from gpu_worker.backends.cpu.backend import CpuBackend

            return CpuBackend(config)
        case "torch":
            from gpu_worker.backends.torch.backend import TorchBackend

            return TorchBackend(device)
        case "triton":
            from gpu_worker.backends.triton.backend import TritonBackend

            return TritonBackend(device)
        case _:
            raise ValueError(f"--device-backend {name!r} is not one of auto, {', '.join(NAMES)}")
