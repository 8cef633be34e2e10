"""Hybrid models on the CPU backend's kernels of the gated delta rule (backends/cpu/gated_delta.py,
put in the Gated DeltaNet layers' slots by prepare.py): a float32 model through the real loader
equals HF float64's greedy tokens over chunked prefill at a chunk size that is no multiple of the
kernel's block of 64 (a prompt's state carried across chunks), mixed batches and the overlap
schedule. (The float64 runs of test_hybrid.py keep the layers' torch code: the kernels take float32
and bfloat16.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch import nn

from gpu_worker.backends.cpu.gated_delta import HfDeltaRule
from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.models.gated_delta import GatedDeltaNet
from tests.exactness import inprocess
from tests.hybrid_models import hf_greedy, make_prompts, save_hybrid

pytestmark = pytest.mark.cpu_kinds

NEW_TOKENS = 6


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next"])
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp(request.param)
    return path, save_hybrid(request.param, path)


def test_kernels_greedy_matches_hf(hybrid: tuple[Path, Any]) -> None:
    path, hf = hybrid
    prompts = make_prompts(5, (1, 5, 70, 23, 140))
    expected = hf_greedy(hf, prompts, NEW_TOKENS)
    config = WorkerConfig(model_path=str(path), dtype="float32", page_size=4, kv_cache_tokens=2048,
                          num_threads=1, max_running_requests=8)  # fmt: skip
    runner = ModelRunner(config)
    assert isinstance(runner.model, nn.Module)
    layers = [m for m in runner.model.modules() if isinstance(m, GatedDeltaNet)]
    assert len(layers) == 3, "three linear layers beside one full attention"
    for layer in layers:
        assert isinstance(layer.recurrent_rule, HfDeltaRule) and isinstance(layer.chunked_rule, HfDeltaRule)
    got, _ = inprocess.generate(runner, prompts, NEW_TOKENS, chunked_prefill_size=37, enable_mixed_chunk=True,
                                overlap=True)  # fmt: skip
    assert got == expected
