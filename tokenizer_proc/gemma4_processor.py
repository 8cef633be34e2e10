"""Gemma 4's processor for images: transformers' Gemma 4 image processor (aspect-preserving resize to
a patch budget, patches padded to it with their grid positions) and the placeholder expansion HF's
Gemma4Processor does (each ``<|image|>`` the template writes becomes ``<|image>``, the image's
``<|image|>`` x its token count, ``<image|>``).

HF's Gemma4Processor cannot be built here: it insists on its video processor, which needs
torchvision, and images need none of it.
"""

from __future__ import annotations

from typing import Any


class Gemma4ImageProcessor:
    """Called as transformers' processors are: text with one image token per image."""

    def __init__(
        self, image_processor: Any, tokenizer: Any, tokens: tuple[str, str, str] | None = None
    ) -> None:
        """``tokens``: the image, begin and end tokens (default: those the tokenizer names)."""
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        if tokens is None:
            tokens = (tokenizer.image_token, tokenizer.boi_token, tokenizer.eoi_token)
        self.image, self.boi, self.eoi = tokens

    def __call__(self, *, text: str, images: list[Any], **_: Any) -> dict[str, Any]:
        import numpy as np

        pieces = text.split(self.image)
        if len(pieces) - 1 != len(images):
            raise ValueError(f"the prompt places {len(pieces) - 1} images for {len(images)} sent")
        out = self.image_processor(images, return_tensors="np")
        counts = [int(n) for n in out["num_soft_tokens_per_image"]]
        expanded = pieces[0] + "".join(
            f"{self.boi}{self.image * n}{self.eoi}{piece}"
            for n, piece in zip(counts, pieces[1:], strict=True)
        )
        ids = self.tokenizer.encode(expanded, add_special_tokens=False)
        return {
            "input_ids": np.asarray([ids]),
            "pixel_values": out["pixel_values"],
            "image_position_ids": out["image_position_ids"],
        }


def gemma4_processor(model_path: str) -> Gemma4ImageProcessor:
    """The processor of the Gemma 4 checkpoint at ``model_path`` (its image processor's config and
    tokenizer, whose ``image_token``, ``boi_token`` and ``eoi_token`` name the image's tokens)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    for name in ("image_token", "boi_token", "eoi_token"):
        if getattr(tokenizer, name, None) is None:
            raise ValueError(f"the tokenizer names no {name}")
    return Gemma4ImageProcessor(AutoImageProcessor.from_pretrained(model_path), tokenizer)
