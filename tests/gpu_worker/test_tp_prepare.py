"""Tensor parallel inside ``Backend.prepare_model`` (tensor_parallel.prepare_rank): the backend lays
out only this rank's shard, and the row-parallel matmul it chose is summed over the ranks by the
all-reduce it was given. One process: the all-reduce is a stand-in that records what it sums."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.backends.cpu.backend import CpuBackend
from gpu_worker.backends.cpu.matmul import CpuLinear
from gpu_worker.backends.torch.backend import TorchBackend
from gpu_worker.config import WorkerConfig
from gpu_worker.tensor_parallel import AllReduced, TensorParallel
from gpu_worker.weights.loader import load_model
from tests.models import save_tiny_model

RANK, WORLD = 1, 2


@pytest.mark.parametrize("backend_name", ["cpu", "torch"])
def test_prepare_model_lays_out_this_ranks_shard_and_reduces_its_row_parallel_matmul(
    backend_name: str, tmp_path: Path
) -> None:
    save_tiny_model("llama", False, tmp_path)  # 4 heads, 2 KV heads, hidden 64
    model: Any
    model, _ = load_model(tmp_path, torch.float32, torch.device("cpu"))
    full_o = model.model.layers[0].self_attn.o_proj.weight.detach().clone()  # [64, 64]
    summed: list[torch.Tensor] = []

    def all_reduce(t: torch.Tensor) -> None:
        summed.append(t.clone())
        t.mul_(2)  # what the stand-in "sum" does, so the caller's result shows it went through

    config = WorkerConfig(model_path=str(tmp_path), dtype="float32", num_threads=1)
    backend = CpuBackend(config) if backend_name == "cpu" else TorchBackend(torch.device("cpu"))
    backend.prepare_model(model, torch.float32, TensorParallel(RANK, WORLD, all_reduce))

    attn = model.model.layers[0].self_attn
    assert (model.num_heads, model.num_kv_heads, attn.num_heads, attn.num_kv_heads) == (2, 1, 2, 1)
    o_proj = attn.o_proj
    assert isinstance(o_proj.impl, AllReduced), "the row-parallel o_proj goes through the all-reduce"
    if backend_name == "cpu":
        assert isinstance(o_proj.impl._matmul, CpuLinear), "around the matmul the backend chose"
    x = torch.randn(3, 32)  # this rank's 2 heads of 16: a layout of the whole weight would refuse it
    y = o_proj.impl(x)
    part = x.double() @ full_o[:, RANK * 32 : (RANK + 1) * 32].double().T  # this rank's partial product
    assert len(summed) == 1 and summed[0].shape == (3, 64)
    torch.testing.assert_close(summed[0].double(), part, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.double(), 2 * part, rtol=1e-5, atol=1e-5)
