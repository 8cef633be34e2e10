"""Gemma 4 in process (scheduler core + model runner) against HF transformers in float64: a tiny model
with every option of the family on (tests/gemma4_models.py), prompts past its sliding window."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from tests.exactness import inprocess
from tests.gemma4_models import save_gemma4
from tests.gpu_worker.helpers import GREEDY, MiniScheduler
from tests.models import VOCAB, WINDOW

NEW_TOKENS = 8
PROMPT_LENS = (1, 3, 17, 40, 9)  # 17 and 40: past the WINDOW-token sliding window


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]


def hf_greedy(model: Any, prompt_ids: list[list[int]]) -> list[list[int]]:
    with torch.no_grad():
        outs = [
            model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False) for p in prompt_ids
        ]
    return [out[0, len(p) :].tolist() for out, p in zip(outs, prompt_ids, strict=True)]


@pytest.fixture(scope="module")
def gemma4_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, list]:
    """(model dir, the HF model, its greedy outputs) of the text model."""
    path = tmp_path_factory.mktemp("gemma4_text")
    model = save_gemma4(path)
    return path, model, hf_greedy(model, prompts())


def runner(path: Path, backend: str, page_size: int) -> ModelRunner:
    config = WorkerConfig(model_path=str(path), dtype="float64", device_backend=backend,
                          page_size=page_size, kv_cache_tokens=1024, num_threads=1)  # fmt: skip
    return ModelRunner(config)


@pytest.mark.parametrize(
    ("backend", "page_size", "chunk", "mixed"),
    [("torch", 4, 5, True), ("cpu", 16, -1, False)],
    ids=["torch-chunked-mixed", "cpu-whole"],
)
def test_greedy_matches_hf(
    gemma4_model: tuple[Path, Any, list], backend: str, page_size: int, chunk: int, mixed: bool
) -> None:
    path, _, expected = gemma4_model
    got, scheduler = inprocess.generate(
        runner(path, backend, page_size),
        prompts(),
        NEW_TOKENS,
        chunked_prefill_size=chunk,
        enable_mixed_chunk=mixed,
    )
    assert len({t for out in expected for t in out}) > NEW_TOKENS, "the reference must not be degenerate"
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"prompt {i} ({PROMPT_LENS[i]} tokens)"
    assert scheduler.kv.used_tokens == 0


def test_multimodal_checkpoint_serves_its_text_model(tmp_path: Path) -> None:
    """A ``gemma4`` checkpoint (a vision tower beside the language model, not loaded): its text
    model's tokens, media placeholder ids embedded as the pad token as HF does without media."""
    model = save_gemma4(tmp_path, multimodal=True)
    few = prompts()[1:4]
    got, _ = inprocess.generate(
        runner(tmp_path, "torch", 4), few, NEW_TOKENS, chunked_prefill_size=5, enable_mixed_chunk=True
    )
    assert got == hf_greedy(model, few)


def test_pool_holds_only_the_layers_that_own_kv(gemma4_model: tuple[Path, Any, list]) -> None:
    """Six layers, the last two KV-shared: four pool layers, each of its layer's own shape (global
    layers: 1 KV head of 32 dims; sliding: 2 of 16)."""
    path, _, _ = gemma4_model
    kv = runner(path, "torch", 4).kv
    assert [tuple(k.shape[1:]) for k in kv.k] == [(2, 16), (1, 32), (2, 16), (1, 32)]
    assert [tuple(v.shape[1:]) for v in kv.v] == [(2, 16), (1, 32), (2, 16), (1, 32)]


def test_logits_match_hf_over_chunks_and_decode_steps(gemma4_model: tuple[Path, Any, list]) -> None:
    """A prompt of 3 windows, prefilled in two chunks then decoded a token a step: every step's
    logits within 1e-12 of HF's full forward, KV-shared layers reading their sources' pages."""
    path, model, _ = gemma4_model
    tokens = [random.Random(3).randrange(3, VOCAB - 8) for _ in range(3 * WINDOW)]
    with torch.no_grad():
        reference = model(torch.tensor([tokens])).logits[0]
    run, pages = runner(path, "torch", 4), MiniScheduler(num_pages=64, page_size=4, shuffle_seed=1)
    start = 0
    for n in (WINDOW + 3, WINDOW, *[1] * (WINDOW - 3)):
        batch = pages.batch([(0, start, tokens[start : start + n], True, GREEDY if start == 0 else None)])
        logits = run.compute_logits(batch)[0]
        start += n
        assert torch.allclose(logits, reference[start - 1], rtol=0, atol=1e-12), f"position {start - 1}"


def test_float32_on_the_cpu_kernels_with_512_wide_global_heads(tmp_path: Path) -> None:
    """Real Gemma 4 global heads are 512 wide, the C attention kernel's and rotary's MAX_HEAD_DIM:
    float32 on the CPU backend runs its kernels on every layer (block matmuls, small ops, the
    attention of sliding and global layers), token-exact against HF float64 (a float32 pool)."""
    model = save_gemma4(tmp_path, head_dim=64, global_head_dim=512)
    few = prompts()[2:4]
    expected = hf_greedy(model, few)
    config = WorkerConfig(model_path=str(tmp_path), dtype="float32", kv_cache_dtype="float32",
                          page_size=4, kv_cache_tokens=1024, num_threads=1)  # fmt: skip
    run = ModelRunner(config)
    assert getattr(run.backend, "kernels", None) is not None, "the kernels serve what fits them"
    assert [tuple(k.shape[1:]) for k in run.kv.k] == [(2, 64), (1, 512), (2, 64), (1, 512)]
    got, _ = inprocess.generate(run, few, NEW_TOKENS, chunked_prefill_size=5, enable_mixed_chunk=True)
    assert got == expected


@pytest.mark.triton_interpreter
def test_triton_backend_float32_matches_hf(gemma4_model: tuple[Path, Any, list]) -> None:
    """The Triton backend (interpreted on CPU): per-layer K/V shapes, unscaled scores, windows and
    KV-shared layers attending over their sources' pages, float32 within HF's top 2 at any
    difference (tests/gpu_worker/backends/test_triton_engine.py's rule)."""
    pytest.importorskip("triton")
    from tests.gpu_worker.backends.test_triton_engine import first_divergence_within_top2

    path, model, _ = gemma4_model
    reference = copy.deepcopy(model).to(torch.float32)
    few = prompts()[3:4]  # past the window
    expected = hf_greedy(reference, few)
    config = WorkerConfig(model_path=str(path), dtype="float32", device_backend="triton", page_size=4,
                          kv_cache_tokens=1024, num_threads=1)  # fmt: skip
    run = ModelRunner(config)
    assert run.backend.name == "triton"
    got, _ = inprocess.generate(run, few, NEW_TOKENS, chunked_prefill_size=24, enable_mixed_chunk=True)
    for prompt, g, e in zip(few, got, expected, strict=True):
        first_divergence_within_top2(reference, prompt, g, e, f"{len(prompt)} tokens")
