"""Hybrid models (Qwen3.5 dense and MoE, Qwen3-Next: Gated DeltaNet layers beside gated full
attention) served by the engine equal HF transformers' greedy tokens.

Tiny random float64 models through the real loader and the recurrent-state pool: chunked prefill at
chunk sizes that are not multiples of the chunked rule's 64 (a prompt's state carried across
chunks), mixed batches, the overlap schedule, retraction and n > 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.models.gated_delta import GatedDeltaNet
from gpu_worker.weights.model_files import resolve_model
from scheduler_proc.state_checkpoints import HybridKVManager
from tests.exactness import inprocess
from tests.hybrid_gguf import write_hybrid_gguf
from tests.hybrid_models import HYBRID_KINDS, hf_greedy, hf_hybrid_model, make_prompts, save_hybrid

NEW_TOKENS = 6
PROMPT_LENS = (1, 5, 70, 23, 140)


@pytest.fixture(scope="module", params=HYBRID_KINDS)
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp(request.param)
    return path, save_hybrid(request.param, path)


def runner_for(path: Path, **extra: Any) -> ModelRunner:
    config: dict[str, Any] = dict(model_path=str(path), dtype="float64", page_size=4, kv_cache_tokens=2048,
                                  num_threads=1, max_running_requests=8)  # fmt: skip
    return ModelRunner(WorkerConfig(**{**config, **extra}))


@pytest.mark.parametrize(("chunk", "mixed", "overlap"), [(37, True, True), (-1, False, False)],
                         ids=["chunk37-mixed-overlap", "whole"])  # fmt: skip
def test_greedy_matches_hf(hybrid: tuple[Path, Any], chunk: int, mixed: bool, overlap: bool) -> None:
    path, hf = hybrid
    prompts = make_prompts(5, PROMPT_LENS)
    expected = hf_greedy(hf, prompts, NEW_TOKENS)
    assert len({t for out in expected for t in out}) > NEW_TOKENS, "the reference must not be degenerate"
    runner = runner_for(path)
    assert runner.states is not None and len(runner.kv.k) == 1, "one KV layer, three linear ones"
    got, scheduler = inprocess.generate(runner, prompts, NEW_TOKENS, chunked_prefill_size=chunk,
                                        enable_mixed_chunk=mixed, overlap=overlap)  # fmt: skip
    assert got == expected
    assert scheduler.kv.used_tokens == 0


@pytest.mark.parametrize("checkpoints", [0, -1], ids=["no-prefix-cache", "checkpoints"])
def test_retraction_recomputes_the_state(hybrid: tuple[Path, Any], checkpoints: int) -> None:
    """A pool so small that requests are retracted: each recomputes from a zeroed state, or from a
    checkpoint of its own where the prefix cache has one; with no checkpoints the prefix cache is off
    (a page hit would resume a stale state)."""
    path, hf = hybrid
    prompts = make_prompts(9, (30, 41, 25, 36))
    expected = hf_greedy(hf, prompts, 12)
    runner = runner_for(path, state_checkpoints=checkpoints)
    tiny_pool = {"num_pages": 40, "schedule_conservativeness": 0.2}
    got, scheduler = inprocess.generate(runner, prompts, 12, chunked_prefill_size=16, enable_mixed_chunk=True,
                                        scheduler_overrides=tiny_pool, overlap=True)  # fmt: skip
    assert scheduler.num_retracted > 0, "the tiny pool must force retraction"
    assert (scheduler.kv.cache is None) == (checkpoints == 0)
    assert got == expected
    if isinstance(scheduler.kv, HybridKVManager):
        scheduler.kv.check_checkpoints()


def test_forks_copy_the_state(hybrid: tuple[Path, Any]) -> None:
    """n > 1: every choice continues from a copy of the prompt's state (greedy: all choices alike)."""
    path, hf = hybrid
    prompts = make_prompts(11, (19, 33))
    expected = hf_greedy(hf, prompts, NEW_TOKENS)
    runner = runner_for(path)
    got, _ = inprocess.generate(
        runner, prompts, NEW_TOKENS, chunked_prefill_size=8, enable_mixed_chunk=True, n=3
    )
    assert got == [out for out in expected for _ in range(3)]


@pytest.mark.parametrize("kind", HYBRID_KINDS[1:])
def test_gguf_matches_hf(kind: str, tmp_path: Path) -> None:
    """The same weights from a GGUF written as llama.cpp's converter writes qwen35 / qwen35moe /
    qwen3next (gguf_hybrid.py undoes its changes; Qwen3.5's value heads computed in its tiled order)."""
    hf = hf_hybrid_model(kind, seed=4)
    hf.load_state_dict(write_hybrid_gguf(tmp_path / "model.gguf", hf), strict=False)
    prompts = make_prompts(13, (3, 37, 70))
    expected = hf_greedy(hf, prompts, NEW_TOKENS)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RIVULET_CACHE_DIR", str(tmp_path / "cache"))
        meta = resolve_model(str(tmp_path / "model.gguf"))
    runner = runner_for(meta, gguf_path=str(tmp_path / "model.gguf"))
    got, _ = inprocess.generate(runner, prompts, NEW_TOKENS, chunked_prefill_size=29, enable_mixed_chunk=True)
    assert got == expected


def test_triton_backend_runs_the_pooled_rule(tmp_path: Path) -> None:
    """The Triton backend's gated delta kernels (under the interpreter without CUDA) in the layers'
    ``pooled_rule`` slot, a prompt in chunks with checkpoints inside them: HF float64's tokens."""
    hf = save_hybrid("qwen3_5_text", tmp_path, seed=5)
    prompts = make_prompts(17, (5, 19))
    expected = hf_greedy(hf, prompts, 3)
    runner = runner_for(tmp_path, dtype="float32", device_backend="triton", kv_cache_tokens=256)
    layer = next(m for m in runner.model.decoder_layers().modules() if isinstance(m, GatedDeltaNet))
    assert layer.pooled_rule is not None and layer.pooled_conv is None
    got, _ = inprocess.generate(runner, prompts, 3, chunked_prefill_size=7, enable_mixed_chunk=True)
    assert got == expected
