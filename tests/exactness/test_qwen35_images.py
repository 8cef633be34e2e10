"""Qwen3.5 with images, served in process, equals HF float64 ``generate``: the tower's embeddings
spliced over the image tokens, the 3D rope positions of those tokens and the offset they leave on
every later token (HF's ``rope_deltas``), across a chunked prefill that cuts inside and right after
an image, a prefix-cache hit over an image, and the decode steps after."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from protocol import WorkerSampling
from protocol.images import ImageInput
from tests.exactness import inprocess
from tests.exactness.test_hybrid import runner_for

transformers = pytest.importorskip("transformers")

PATCH, MERGE, IMAGE, START, END = 16, 2, 299, 298, 297
NEW_TOKENS = 5
# HF's float32 steps (its rope table, its reference linear attention) leave a text-only prompt's
# logprobs ~1e-7 off ours; 1D positions for the image tokens would put them ~1e-4 off.
LOGPROB_TOLERANCE = 1e-6
LOGPROBS = WorkerSampling(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0, logprobs=True)
CHUNK = 7


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A tiny Qwen3.5 VLM (one linear and one full-attention layer) saved with its image processor."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = tmp_path_factory.mktemp("qwen35_vlm_serve")
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48,
                  num_position_embeddings=36, patch_size=PATCH, spatial_merge_size=MERGE)  # fmt: skip
    text = dict(vocab_size=300, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                layer_types=["linear_attention", "full_attention"], num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
                linear_key_head_dim=8, linear_value_head_dim=8,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                     mrope_section=[1, 2, 1], mrope_interleaved=True))  # fmt: skip
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=IMAGE,
                                        vision_start_token_id=START, vision_end_token_id=END)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(config).to(torch.float64).eval()
    with torch.no_grad():
        for name, param in model.model.visual.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
        model.model.language_model.embed_tokens.weight.normal_(0.0, 1.0)
    model.save_pretrained(out, safe_serialization=True)
    Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2, min_pixels=32 * 32,
                             max_pixels=256 * 256).save_pretrained(out)  # fmt: skip
    return out, model


def _prompt(layout: list[Any], seed: int) -> tuple[list[int], list[ImageInput], torch.Tensor, torch.Tensor]:
    """Token ids with an image run per ``(text before, (height, width))``, the images as the
    tokenizer process hands them on (through qwen_processor.py), HF's pixel_values and grids."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tokenizer_proc.images import _image_input
    from tokenizer_proc.qwen_processor import QwenImageProcessor, per_image_pixels

    rng = np.random.default_rng(seed)
    processor = Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
                                         min_pixels=32 * 32, max_pixels=256 * 256)  # fmt: skip
    pictures = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _, (h, w) in layout]
    out = processor(images=pictures, return_tensors="np")
    grids = np.asarray(out["image_grid_thw"])
    qwen = QwenImageProcessor(processor, None)  # type: ignore[arg-type]
    ids: list[int] = []
    images: list[ImageInput] = []
    for (text, _), grid, px in zip(layout, grids, per_image_pixels(out["pixel_values"], grids), strict=True):
        ids += [int(t) for t in rng.integers(3, 290, text)] + [START]
        length = int(grid.prod()) // MERGE**2
        one = np.ascontiguousarray(px, dtype=np.float32)
        images.append(_image_input(len(ids), length, one, qwen.rope_delta(one.shape, length)))
        ids += [IMAGE] * length + [END]
    ids += [int(t) for t in rng.integers(3, 290, 6)]
    return ids, images, torch.from_numpy(out["pixel_values"]).double(), torch.from_numpy(grids)


def _hf_greedy(
    model: Any, ids: list[int], pixels: torch.Tensor, grids: torch.Tensor
) -> tuple[list[int], list[float]]:
    """HF's greedy tokens and their logprobs."""
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), pixel_values=pixels,
                             image_grid_thw=grids, mm_token_type_ids=(input_ids == IMAGE).long(),
                             max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
    tokens = out.sequences[0, len(ids) :]
    logprobs = [torch.log_softmax(step[0], dim=-1)[t] for step, t in zip(out.logits, tokens, strict=True)]
    return [int(t) for t in tokens], [float(lp) for lp in logprobs]


def test_images_match_hf_across_chunks_and_a_prefix_hit(vlm: tuple[Path, Any]) -> None:
    path, hf = vlm
    layouts = [[(3, (64, 96)), (2, (128, 128))], [(4, (96, 64))]]
    prompts = [_prompt(layout, seed) for seed, layout in enumerate(layouts)]
    assert all(image.rope_delta < 0 for _, images, _, _ in prompts for image in images)
    reference = [_hf_greedy(hf, ids, px, grids) for ids, _, px, grids in prompts]
    expected = [tokens for tokens, _ in reference]
    expected_logprobs = [lps for _, lps in reference]
    # The first prompt again right after it: its prefill hits the cache past both images.
    ids = [prompts[0][0], prompts[0][0], prompts[1][0]]
    images = [prompts[0][1], prompts[0][1], prompts[1][1]]
    expected.insert(1, expected[0])
    expected_logprobs.insert(1, expected_logprobs[0])
    runner = runner_for(path, state_checkpoints=-1)
    assert runner.images is not None and runner.mrope_merge == MERGE
    batches: list[Any] = []
    logprobs: list[list[float]] = []
    # Chunks of 7: the first prompt's first chunk ends inside its first image, a later one right
    # after its END token; one request at a time so the repeat finds the first in the cache.
    got, scheduler = inprocess.generate(runner, ids, NEW_TOKENS, chunked_prefill_size=CHUNK,
                                        enable_mixed_chunk=True, batches=batches, images=images,
                                        sampler=LOGPROBS, logprobs=logprobs,
                                        scheduler_overrides={"max_running_requests": 1})  # fmt: skip
    assert got == expected
    for lps, want in zip(logprobs, expected_logprobs, strict=True):
        assert max(abs(a - b) for a, b in zip(lps, want, strict=True)) < LOGPROB_TOLERANCE
    assert len({t for out in expected for t in out}) > 2, "the reference must not be degenerate"
    hits = [b for b in batches if b.rope_offsets and any(s > 0 and not b.images for s in b.prefix_lens)]
    assert hits, "some row starts past an image without carrying it"
    hit = max(start for b in batches for start, new in zip(b.prefix_lens, b.sampler, strict=True) if new)
    assert hit > prompts[0][1][-1].end, "the repeat's cache hit reaches past its last image"
    assert scheduler.kv.used_tokens == 0
