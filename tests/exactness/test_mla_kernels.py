"""Latent attention's absorbed decode on the device backends' kernels: the paged attention over the
latent pool as MQA (one KV head of kv_lora_rank + qk_rope_head_dim dimensions, the value the same row)
on the CPU's C kernel (every CPU kind) and on Triton (interpreted on CPU), against HF's float64
greedy tokens and the torch backend's float32 hidden states."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from tests.exactness import inprocess
from tests.mla_models import hf_greedy, make_prompts, save_mla_model

NEW_TOKENS = 4
PROMPT_LENS = (1, 3, 17)


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """GLM's shape: K heads of 24 + 8, V heads of 32, a latent row of 32 + 8."""
    path = tmp_path_factory.mktemp("mla-kernels")
    return path, save_mla_model("glm", path)


def _run(
    path: Path, backend: str, form: str, kv_dtype: str = "float32"
) -> tuple[list[list[int]], list[torch.Tensor]]:
    runner = ModelRunner(WorkerConfig(model_path=str(path), dtype="float32", page_size=16,
                                      kv_cache_tokens=256,
                                      num_threads=1, device_backend=backend, latent_attention=form,
                                      kv_cache_dtype=kv_dtype))  # fmt: skip
    steps: list[torch.Tensor] = []
    model: Any = runner.model
    model.register_forward_hook(lambda _m, _args, out: steps.append(out.clone()))
    prompts = make_prompts(3, PROMPT_LENS)
    got, _ = inprocess.generate(runner, prompts, NEW_TOKENS, chunked_prefill_size=8, enable_mixed_chunk=True)
    return got, steps


@pytest.mark.cpu_kinds
def test_c_kernel_absorbed_decode(glm: tuple[Path, Any]) -> None:
    """The CPU backend's decode steps run on its C attention kernel (and its matmuls): equal to the torch
    backend's within float32 rounding, relative to the hidden states' scale."""
    path, hf = glm
    got, steps = _run(path, "cpu", "absorbed")
    assert got == hf_greedy(hf, make_prompts(3, PROMPT_LENS), NEW_TOKENS)
    _, reference = _run(path, "torch", "absorbed")
    assert len(steps) == len(reference)
    for ours, theirs in zip(steps, reference, strict=True):  # float32 sums in other orders, 3 layers deep
        assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()


@pytest.mark.cpu_kinds
def test_c_kernel_on_a_16_bit_pool(glm: tuple[Path, Any]) -> None:
    """A float16 latent pool (the CPU's auto under float32) gives HF's greedy tokens too."""
    path, hf = glm
    got, _ = _run(path, "cpu", "auto", kv_dtype="float16")
    assert got == hf_greedy(hf, make_prompts(3, PROMPT_LENS), NEW_TOKENS)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("form", ["absorbed", "auto"])
def test_triton_absorbed_decode(glm: tuple[Path, Any], form: str) -> None:
    path, hf = glm
    got, _ = _run(path, "triton", form)
    assert got == hf_greedy(hf, make_prompts(3, PROMPT_LENS), NEW_TOKENS)
