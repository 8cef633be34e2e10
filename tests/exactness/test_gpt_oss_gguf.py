"""gpt-oss from a GGUF written as llama.cpp's converter writes one (tests/gpt_oss_gguf.py: ``gpt-oss``,
experts in MXFP4): in float64, its blocks dequantized at load, HF's greedy tokens over chunked prefill,
mixed batches and a prefix-cache hit; in float32 on the CPU kernels, the experts kept in their MXFP4
blocks give the tokens of the same file's dequantized twin."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.backends.cpu.clamped_experts import ClampedQuantExperts
from gpu_worker.models.gpt_oss import ClampedSwigluExperts
from tests.exactness import inprocess
from tests.exactness.test_gpt_oss import hf_gpt_oss, make_prompts, tiny_gpt_oss_config
from tests.exactness.test_moe import hf_greedy, runner_for
from tests.gpt_oss_gguf import Q, write_gpt_oss_gguf
from tests.gpu_worker.helpers import GREEDY, MiniScheduler

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """(dir holding model.gguf, the HF reference with the file's MXFP4 expert values)."""
    path = tmp_path_factory.mktemp("gpt_oss_gguf")
    model = hf_gpt_oss(tiny_gpt_oss_config(layers=3, swiglu_limit=7.0), seed=4)  # a GGUF states no limit
    write_gpt_oss_gguf(path / "model.gguf", model, Q.MXFP4)
    return path, model


@pytest.mark.parametrize(("chunk", "mixed"), [(5, True), (256, False)], ids=["chunk5-mixed", "whole"])
def test_gguf_greedy_matches_hf(gguf_dir: tuple[Path, Any], chunk: int, mixed: bool) -> None:
    path, hf = gguf_dir
    prompts = make_prompts(seed=6, lens=(1, 19, 33, 9))
    prompts.append(prompts[2][:24] + prompts[1][:5])  # the third prompt's first 24 tokens again
    expected = hf_greedy(hf, prompts, NEW_TOKENS)
    runner = runner_for(path, "gguf")
    assert runner.model.model.layers[1].attention.sliding_window == 0  # type: ignore[attr-defined]
    got, scheduler = inprocess.generate(runner, prompts, NEW_TOKENS, chunked_prefill_size=chunk,
                                        enable_mixed_chunk=mixed, max_prefill_tokens=40)  # fmt: skip
    assert len({t for out in expected for t in out}) > NEW_TOKENS, "the reference must not be degenerate"
    assert got == expected
    assert scheduler.num_cached_prompt_tokens > 0, "no prefix-cache hit"


def test_mxfp4_experts_kept_in_blocks_match_their_dequantized_twin(gguf_dir: tuple[Path, Any]) -> None:
    """float32 on the C kernels: the experts held as MXFP4 blocks (computed on them, on 16-bit
    activations, or 8-bit ones for an expert with quant.py's A8_MIN_ROWS rows: a prefill's) and the
    same weights dequantized at load: the same greedy tokens, logits within 1% of their spread (8 bits
    measured 0.4%, 16 bits 0.1%)."""
    path, _ = gguf_dir
    prompts = make_prompts(seed=7, lens=(3, 21, 12))
    kept = runner_for(path, "gguf", dtype="float32")
    twin = runner_for(path, "gguf", dtype="float32", weight_dtype="float32")
    experts: Any = kept.model.model.layers[0].mlp.experts  # type: ignore[attr-defined]
    assert isinstance(experts, ClampedSwigluExperts) and isinstance(experts.impl, ClampedQuantExperts)
    assert experts.quantized is not None
    assert {p.type for p in experts.quantized.projections} == {int(Q.MXFP4)}
    assert experts.gate_up_proj.numel() == 0, "the experts are not widened"
    assert twin.model.model.layers[0].mlp.experts.quantized is None  # type: ignore[attr-defined]
    got, _ = inprocess.generate(kept, prompts, NEW_TOKENS, chunked_prefill_size=8, enable_mixed_chunk=True)
    want, _ = inprocess.generate(twin, prompts, NEW_TOKENS, chunked_prefill_size=8, enable_mixed_chunk=True)
    assert got == want
    logits = [r.compute_logits(MiniScheduler(r.num_pages, 4).batch([(0, 0, prompts[1], True, GREEDY)]))
              for r in (kept, twin)]  # fmt: skip
    spread = float(logits[1].max() - logits[1].min())
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0.01 * spread)
