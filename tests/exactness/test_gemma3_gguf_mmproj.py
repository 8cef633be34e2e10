"""Gemma 3's language model from a GGUF and its vision tower from an mmproj GGUF (--mmproj), run by
the worker over prompts with images, token for token against HF float64 holding the weights the two
files hold (their float32 and float16 rounding), image tokens attending both ways."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from protocol.chat import ChatMessage, ContentPart, ImagePart, TextPart
from protocol.messages import ForwardBatch
from tests.gguf_writer import write_gguf
from tests.gpu_worker.test_mmproj import rounded_as_the_file
from tests.models import GREEDY
from tests.vision_models import encoded, random_image, save_tiny_gemma3_vlm, solid_image, write_gemma3_mmproj
from tokenizer_proc.images import ImageLimits, VisionProcessor

NEW_TOKENS = 6
PAGE = 4


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> tuple[Path, Any, Any]:
    out = tmp_path_factory.mktemp("gemma3-gguf")
    model, processor = save_tiny_gemma3_vlm(out, smollm2_dir)
    model.load_state_dict(write_gguf(out / "model.gguf", model), strict=False)
    write_gemma3_mmproj(model, out / "mmproj.gguf")
    rounded_as_the_file(model)
    return out, model, processor


def served(runner: ModelRunner, ids: list[int], images: list[Any]) -> list[int]:
    """Greedy tokens of one request: its prompt in one row, then a decode row per token."""
    pages = math.ceil((len(ids) + NEW_TOKENS) / PAGE)
    batch = ForwardBatch(step=0, req_pool_idx=[0], prefix_lens=[0], extend_lens=[len(ids)], input_ids=ids,
                         page_starts=[0], page_counts=[pages], pages=list(range(pages)), sample=[True],
                         sampler=[GREEDY], images=images, image_rows=[0] * len(images))  # fmt: skip
    out = runner.execute(batch).token_ids
    for step in range(1, NEW_TOKENS):
        batch = ForwardBatch(step=step, req_pool_idx=[0], prefix_lens=[len(ids) + step - 1],
                             extend_lens=[1], input_ids=[out[-1]], page_starts=[pages], page_counts=[0],
                             pages=[], sample=[True], sampler=[None])  # fmt: skip
        out += runner.execute(batch).token_ids
    return out


def test_gguf_and_mmproj_match_hf(files: tuple[Path, Any, Any]) -> None:
    path, model, processor = files
    runner = ModelRunner(WorkerConfig(model_path=str(path), gguf_path=str(path / "model.gguf"),
                                      mmproj=str(path / "mmproj.gguf"), dtype="float64", page_size=PAGE,
                                      kv_cache_tokens=256, num_threads=1))  # fmt: skip
    vision = VisionProcessor.load(str(path), ImageLimits())
    assert vision is not None
    files_ = [encoded(random_image(5, 48, 64), "PNG"), encoded(solid_image((200, 180, 20), 64, 64), "JPEG")]
    parts: list[ContentPart] = [
        TextPart(text="Compare "),
        ImagePart(data=files_[0]),
        TextPart(text=" with "),
        ImagePart(data=files_[1]),
    ]
    template = [{"type": "text", "text": "Compare "}, {"type": "image"}, {"type": "text", "text": " with "},
                {"type": "image"}]  # fmt: skip
    text = processor.apply_chat_template([{"role": "user", "content": template}], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip
    ids, images = vision.prompt(text, [ChatMessage(role="user", parts=parts)])
    inputs = processor(text=text, images=[Image.open(io.BytesIO(f)).convert("RGB") for f in files_],
                       return_tensors="pt", add_special_tokens=False)  # fmt: skip
    assert inputs["input_ids"][0].tolist() == ids
    with torch.no_grad():
        want = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids) :].tolist()
    assert len(set(want)) > 2, "the reference must not be degenerate"
    assert served(runner, ids, images) == want
