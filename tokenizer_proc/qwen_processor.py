"""Qwen3.5's processor for images, without transformers' Qwen3VLProcessor (which will not build
without its video processor, and that needs torchvision): transformers' Qwen2-VL image processor
for the pixels (Qwen3.5's ``preprocessor_config.json`` names it), and Qwen's placeholder expansion,
each ``<|image_pad|>`` of the rendered prompt repeated once per merged patch of its image's grid
(``t * h * w / merge^2``), as HF's processor writes it.

Each image's pixels come out as its own ``[t, h, w, patch]`` array: the processor's flat patch rows
for it (in merge-block order) shaped by its grid, which is how the worker's tower
(gpu_worker/models/qwen35_vision.py) and the 3D rope positions (qwen35_positions.py) read the grid.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    from transformers import PreTrainedTokenizerBase

IMAGE = "<|image_pad|>"


class QwenImageProcessor:
    """Called as transformers' processors are: the rendered text holds one ``<|image_pad|>`` per image."""

    def __init__(self, image_processor: Any, tokenizer: PreTrainedTokenizerBase) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.merge = int(image_processor.merge_size)

    def __call__(self, *, text: str, images: list[Any], **_: Any) -> dict[str, Any]:
        import numpy as np

        pieces = text.split(IMAGE)
        if len(pieces) - 1 != len(images):
            raise ValueError(f"the prompt places {len(pieces) - 1} images for {len(images)} sent")
        pixels: list[np.ndarray] = []
        grids = np.zeros((0, 3), dtype=np.int64)
        if images:
            out = self.image_processor(images, return_tensors="np")
            grids = np.asarray(out["image_grid_thw"], dtype=np.int64)
            pixels = per_image_pixels(np.asarray(out["pixel_values"]), grids)
        expanded = pieces[0]
        for grid, piece in zip(grids, pieces[1:], strict=True):
            expanded += IMAGE * (int(grid.prod()) // self.merge**2) + piece
        ids = self.tokenizer.encode(expanded, add_special_tokens=False)
        return {"input_ids": np.asarray([ids]), "pixel_values": pixels, "image_grid_thw": grids}

    def rope_delta(self, shape: Sequence[int], length: int) -> int:
        """An image's 3D position span (its merged grid's larger side) minus its token count."""
        return max(shape[1], shape[2]) // self.merge - length


def per_image_pixels(pixel_values: np.ndarray, grids: np.ndarray) -> list[np.ndarray]:
    """The processor's flat patch rows of all images split per image, each ``[t, h, w, patch]``."""
    import numpy as np

    counts = [int(t * h * w) for t, h, w in grids]
    if sum(counts) != len(pixel_values):
        raise ValueError(f"{len(pixel_values)} patch rows for grids of {sum(counts)}")
    bounds = np.cumsum(counts)[:-1]
    return [
        part.reshape(int(t), int(h), int(w), -1)
        for part, (t, h, w) in zip(np.split(pixel_values, bounds), grids, strict=True)
    ]


def qwen_processor(
    model_path: str | Path, tokenizer: PreTrainedTokenizerBase
) -> tuple[QwenImageProcessor, int]:
    """The processor of the checkpoint at ``model_path`` and its image token id; ValueError for a
    tokenizer without Qwen's image token."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    token = tokenizer.convert_tokens_to_ids(IMAGE)
    if not isinstance(token, int) or token == tokenizer.unk_token_id:
        raise ValueError(f"the model's tokenizer lacks Qwen's image token {IMAGE}")
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(model_path))
    return QwenImageProcessor(image_processor, tokenizer), int(token)
