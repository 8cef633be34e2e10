"""Gemma 4 and Qwen3.5 with their language models from GGUFs and their vision towers from llama.cpp
mmproj GGUFs (--mmproj; both written as its converter writes them), run by the worker over prompts
with images, token for token against HF float64 holding the weights the files hold (F32).

Gemma 4: the processor's prompt in one row, its image tokens attending both ways on the sliding
layers (the text config's "vision"); Qwen3.5: its 3D rope positions, a chunked prefill cutting
inside an image, and logprobs as close as the HF-directory test holds them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from protocol.chat import ChatMessage, ContentPart, ImagePart, TextPart
from tests.exactness import inprocess
from tests.exactness.test_gemma3_gguf_mmproj import NEW_TOKENS, PAGE, served
from tests.exactness.test_hybrid import runner_for
from tests.exactness.test_qwen35_images import LOGPROB_TOLERANCE, LOGPROBS, _hf_greedy, _prompt
from tests.gemma4_gguf import write_gemma4_gguf
from tests.gemma4_vision_models import save_tiny_gemma4_vlm
from tests.hybrid_gguf import write_hybrid_gguf
from tests.mmproj_writers import (
    rounded_to_float32,
    save_tiny_qwen35_vlm,
    write_gemma4_mmproj,
    write_qwen35_mmproj,
)
from tests.vision_models import encoded, hf_greedy, random_image, solid_image


def test_gemma4_gguf_and_mmproj_match_hf(tmp_path: Path, smollm2_dir: Path) -> None:
    from tokenizer_proc.images import ImageLimits, VisionProcessor

    model, processor = save_tiny_gemma4_vlm(tmp_path, smollm2_dir)
    model.load_state_dict(write_gemma4_gguf(tmp_path / "model.gguf", model), strict=False)
    write_gemma4_mmproj(model, processor.image_processor, tmp_path / "mmproj.gguf")
    rounded_to_float32(model.model.vision_tower)
    rounded_to_float32(model.model.embed_vision)
    runner = ModelRunner(WorkerConfig(model_path=str(tmp_path), gguf_path=str(tmp_path / "model.gguf"),
                                      mmproj=str(tmp_path / "mmproj.gguf"), dtype="float64", page_size=PAGE,
                                      kv_cache_tokens=512, num_threads=1))  # fmt: skip
    assert runner.images is not None and runner.images.bidirectional
    vision = VisionProcessor.load(str(tmp_path), ImageLimits())
    assert vision is not None
    files = [encoded(random_image(5, 50, 70), "PNG"), encoded(solid_image((200, 180, 20), 40, 90), "JPEG")]
    parts: list[ContentPart] = [TextPart(text="Compare "), ImagePart(data=files[0]), TextPart(text=" with "),
                                ImagePart(data=files[1])]  # fmt: skip
    template = [{"type": "text", "text": "Compare "}, {"type": "image"}, {"type": "text", "text": " with "},
                {"type": "image"}]  # fmt: skip
    text = processor.apply_chat_template([{"role": "user", "content": template}], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip
    ids, images = vision.prompt(text, [ChatMessage(role="user", parts=parts)])
    want_ids, want = hf_greedy(model, processor, text, files, NEW_TOKENS)
    assert ids == want_ids and [i.length for i in images] == [63, 60]
    assert len(set(want)) > 2, "the reference must not be degenerate"
    assert served(runner, ids, images) == want


def test_gemma4_gguf_alone_and_mmproj_match_hf(
    tmp_path: Path, smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No config.json of the multimodal checkpoint beside the files: the media placeholders from the
    GGUF's vocabulary (embedded as the pad token, as HF's multimodal model does), the image tokens'
    two-way attention from the width (llama.cpp's rule: E2B's and E4B's causal, the rest "vision")."""
    from gpu_worker.weights.model_files import resolve_model
    from tokenizer_proc.images import ImageLimits, VisionProcessor

    model, processor = save_tiny_gemma4_vlm(tmp_path, smollm2_dir)
    files = tmp_path / "gguf"
    files.mkdir()
    vocab = processor.tokenizer.convert_ids_to_tokens(list(range(len(processor.tokenizer))))
    model.load_state_dict(write_gemma4_gguf(files / "model.gguf", model, token_list=vocab), strict=False)
    write_gemma4_mmproj(model, processor.image_processor, files / "mmproj.gguf")
    rounded_to_float32(model.model.vision_tower)
    rounded_to_float32(model.model.embed_vision)
    monkeypatch.setenv("RIVULET_CACHE_DIR", str(tmp_path / "cache"))
    meta = resolve_model(str(files / "model.gguf"))
    assert not (files / "config.json").exists()
    runner = ModelRunner(WorkerConfig(model_path=str(meta), gguf_path=str(files / "model.gguf"),
                                      mmproj=str(files / "mmproj.gguf"), dtype="float64", page_size=PAGE,
                                      kv_cache_tokens=512, num_threads=1))  # fmt: skip
    assert runner.images is not None and runner.images.bidirectional
    media = [processor.tokenizer.convert_tokens_to_ids(t) for t in ("<|image|>", "<|video|>", "<|audio|>")]
    assert sorted(runner.model.media_token_ids.tolist()) == sorted(media)  # type: ignore[attr-defined]
    vision = VisionProcessor.load(str(tmp_path), ImageLimits())  # the prompt as the HF test's
    assert vision is not None
    files_ = [encoded(random_image(6, 60, 50), "PNG")]
    parts: list[ContentPart] = [TextPart(text="What is "), ImagePart(data=files_[0])]
    template = [{"type": "text", "text": "What is "}, {"type": "image"}]
    text = processor.apply_chat_template([{"role": "user", "content": template}], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip
    ids, images = vision.prompt(text, [ChatMessage(role="user", parts=parts)])
    want_ids, want = hf_greedy(model, processor, text, files_, NEW_TOKENS)
    assert ids == want_ids
    assert len(set(want)) > 2, "the reference must not be degenerate"
    assert served(runner, ids, images) == want


@pytest.mark.timeout(600)
def test_qwen35_gguf_and_mmproj_match_hf(tmp_path: Path) -> None:
    model, image_processor = save_tiny_qwen35_vlm(tmp_path)
    model.load_state_dict(write_hybrid_gguf(tmp_path / "model.gguf", model), strict=False)
    write_qwen35_mmproj(model, image_processor, tmp_path / "mmproj.gguf")
    rounded_to_float32(model.model.visual)
    prompts = [_prompt(layout, seed) for seed, layout in enumerate([[(3, (64, 96)), (2, (96, 64))]])]
    reference = [_hf_greedy(model, ids, pixels, grids) for ids, _, pixels, grids in prompts]
    runner = runner_for(
        tmp_path, gguf_path=str(tmp_path / "model.gguf"), mmproj=str(tmp_path / "mmproj.gguf")
    )
    assert runner.images is not None and runner.mrope_merge == 2
    logprobs: list[list[float]] = []
    got, _ = inprocess.generate(runner, [p[0] for p in prompts], len(reference[0][0]), chunked_prefill_size=7,
                                enable_mixed_chunk=True, images=[p[1] for p in prompts], sampler=LOGPROBS,
                                logprobs=logprobs)  # fmt: skip
    assert got == [tokens for tokens, _ in reference]
    assert len({t for out in got for t in out}) > 2, "the reference must not be degenerate"
    for lps, (_, want) in zip(logprobs, reference, strict=True):
        assert max(abs(a - b) for a, b in zip(lps, want, strict=True)) < LOGPROB_TOLERANCE


@pytest.mark.timeout(600)
def test_qwen35_gguf_alone_and_mmproj_match_hf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As llama-server users have them: no HF config.json beside the files, the mrope sections from
    the GGUF's rope.dimension_sections and the merge size from the mmproj's metadata."""
    from gpu_worker.weights.model_files import resolve_model

    model, image_processor = save_tiny_qwen35_vlm(tmp_path / "hf")
    files = tmp_path / "gguf"
    files.mkdir()
    model.load_state_dict(write_hybrid_gguf(files / "model.gguf", model), strict=False)
    write_qwen35_mmproj(model, image_processor, files / "mmproj.gguf")
    rounded_to_float32(model.model.visual)
    ids, images, pixels, grids = _prompt([(3, (64, 96)), (2, (96, 64))], 1)
    want, _ = _hf_greedy(model, ids, pixels, grids)
    monkeypatch.setenv("RIVULET_CACHE_DIR", str(tmp_path / "cache"))
    meta = resolve_model(str(files / "model.gguf"))
    assert not (files / "config.json").exists()
    runner = runner_for(meta, gguf_path=str(files / "model.gguf"), mmproj=str(files / "mmproj.gguf"))
    assert runner.model.mrope_sections == [1, 2, 1] and runner.mrope_merge == 2  # type: ignore[attr-defined]
    got, _ = inprocess.generate(
        runner, [ids], len(want), chunked_prefill_size=7, enable_mixed_chunk=True, images=[images]
    )
    assert got == [want]
    assert len(set(want)) > 2, "the reference must not be degenerate"
