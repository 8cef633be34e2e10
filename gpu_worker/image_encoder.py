"""The worker's images: the vision tower run over a step's new images, batched, before the forward
that needs them, and its outputs cached by image hash, so a prompt whose chunks cut through an
image's tokens, or an image sent again, is encoded once.

A ForwardBatch lists, per row, the images with tokens among the row's positions
(``ForwardBatch.images`` / ``image_rows``); ``splice`` gives the flat token indices of those
positions and the embeddings that replace theirs (``ForwardContext.images``; the model's forward
puts them in place after its embedding scale, as HF does). The batch's ``prefetch_images``, waiting
requests' images, are encoded in the same tower calls and cached for the batches that reach them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path

import numpy as np
import torch

from gpu_worker.models.vision import VisionTower
from protocol.images import ImageInput
from protocol.messages import ForwardBatch
from protocol.worker_messages import PREFETCH_IMAGES

logger = logging.getLogger(__name__)

# Encoded images kept (least recently used dropped first): enough for several batches' prefetched
# images to wait for their requests.
CACHED_IMAGES = 8 * PREFETCH_IMAGES


@dataclass(frozen=True)
class ImageSplice:
    """Which of the batch's tokens are image positions, and their embeddings."""

    index: torch.Tensor  # [N] flat token indices into the batch
    values: torch.Tensor  # [N, hidden]
    # An extend row's flat start -> its images' position ranges, where the model's image tokens
    # attend to each other both ways (Gemma 3's, as HF's mask does); empty: causal.
    blocks: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)


class ImageEncoder:
    """The vision tower and its outputs, by image key."""

    def __init__(self, tower: VisionTower, device: torch.device, dtype: torch.dtype) -> None:
        self.tower = tower
        self.device, self.dtype = device, dtype
        self.cache: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.bidirectional = bool(getattr(tower, "bidirectional", False))
        self.encoded_batches: list[int] = []  # images per tower call, for tests and logs

    def splice(self, batch: ForwardBatch) -> ImageSplice | None:
        """The batch's image positions and their embeddings (None: it has none); raises ValueError
        on an image the tower's output does not fit."""
        self._encode_new(batch.images, batch.prefetch_images[:PREFETCH_IMAGES])
        if not batch.images:
            self._evict()
            return None
        starts = list(accumulate(batch.extend_lens, initial=0))
        index: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        blocks: dict[int, tuple[tuple[int, int], ...]] = {}
        for row, image in zip(batch.image_rows, batch.images, strict=True):
            first, end = batch.prefix_lens[row], batch.prefix_lens[row] + batch.extend_lens[row]
            lo, hi = max(image.offset, first), min(image.end, end)
            if lo >= hi:
                raise ValueError(f"image {image.key} has no tokens in row {row}")
            flat = starts[row] + lo - first
            index.append(torch.arange(flat, flat + hi - lo))
            values.append(self.cache[image.key][lo - image.offset : hi - image.offset])
            if self.bidirectional:
                blocks[starts[row]] = (*blocks.get(starts[row], ()), (image.offset, image.end))
        self._evict()
        return ImageSplice(torch.cat(index).to(self.device), torch.cat(values), blocks)

    def _encode_new(self, images: list[ImageInput], prefetch: list[ImageInput]) -> None:
        """Run the tower once per pixel shape over the images not cached yet. A prefetched image
        that does not fit is skipped, not an error: its own request's batch meets it again."""
        new: dict[int, ImageInput] = {}
        for image in images + [image for image in prefetch if _fits(image)]:
            if image.key in self.cache:
                self.cache.move_to_end(image.key)
            else:
                new.setdefault(image.key, image)
        own = {image.key for image in images}
        by_shape: dict[tuple[int, ...], list[ImageInput]] = {}
        for image in new.values():
            by_shape.setdefault(tuple(image.shape), []).append(image)
        for shape, group in by_shape.items():
            pixels = torch.from_numpy(np.stack([_pixels(image, shape) for image in group]))
            with torch.inference_mode():
                out = self.tower(pixels.to(self.device, self.dtype))
            self.encoded_batches.append(len(group))
            logger.info("vision tower: %d image(s) of %s in one call", len(group), list(shape))
            for image, embeds in zip(group, out, strict=True):
                if embeds.shape[0] != image.length and image.key not in own:
                    continue
                if embeds.shape[0] != image.length:
                    raise ValueError(
                        f"image {image.key}: {image.length} image tokens, the tower gives {embeds.shape[0]}"
                    )
                self.cache[image.key] = embeds

    def _evict(self) -> None:
        while len(self.cache) > CACHED_IMAGES:
            self.cache.popitem(last=False)


def _fits(image: ImageInput) -> bool:
    return len(image.pixels) == 4 * int(np.prod(image.shape))


def _pixels(image: ImageInput, shape: tuple[int, ...]) -> np.ndarray:
    count = int(np.prod(shape))
    if len(image.pixels) != 4 * count:
        raise ValueError(f"image {image.key}: {len(image.pixels)} bytes of pixels for shape {list(shape)}")
    return np.frombuffer(image.pixels, dtype=np.float32).reshape(shape)


# The towers served: tokenizer_proc/images.py's VISION_MODEL_TYPES.
SERVED_TOWERS = ("gemma3", "gemma4", "qwen3_5")


def image_encoder_for(
    model_path: str, dtype: torch.dtype, device: torch.device, mmproj: str | None = None
) -> ImageEncoder | None:
    """The encoder of the model at ``model_path`` (its tower from ``mmproj``, an mmproj GGUF, when
    given), or None for a model without a vision tower we serve."""
    from gpu_worker.models.vision import load_vision_tower
    from gpu_worker.weights.loader import load_hf_config
    from gpu_worker.weights.mmproj import load_mmproj_tower

    if mmproj is not None:
        config = load_hf_config(model_path) if (Path(model_path) / "config.json").is_file() else None
        return ImageEncoder(load_mmproj_tower(mmproj, dtype, device, config), device, dtype)
    if not Path(model_path).is_dir() or load_hf_config(model_path).model_type not in SERVED_TOWERS:
        return None
    tower = load_vision_tower(model_path, dtype, device)
    return None if tower is None else ImageEncoder(tower, device, dtype)


def splice_images(x: torch.Tensor, images: ImageSplice | None) -> torch.Tensor:
    """``x`` [T, hidden] with the image positions' rows replaced by their embeddings."""
    if images is None:
        return x
    return x.index_copy(0, images.index, images.values.to(x.dtype))


def batch_images(encoder: ImageEncoder | None, batch: ForwardBatch) -> ImageSplice | None:
    """``encoder.splice(batch)``; a batch with images for a model without a tower is an error (its
    image tokens would be read as text)."""
    if encoder is None:
        if batch.images:
            raise ValueError("the batch has images and this model has no vision tower")
        return None
    return encoder.splice(batch) if batch.images or batch.prefetch_images else None
