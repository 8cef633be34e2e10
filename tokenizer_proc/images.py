"""Images in the tokenizer process: a message's image parts read and decoded (pillow), the model's
own processor (transformers') run on them and the rendered prompt, and each image's run of image
tokens handed on as an ``ImageInput`` with its pixels and their hash.

This is the only process that decodes or processes an image: the scheduler sees token ids and a
hash per image, the worker the processed pixels it encodes (gpu_worker/image_encoder.py). Which
model a processor belongs to is transformers' business (``AutoProcessor``); what this module needs
of it is that each image becomes one pixel tensor and one run of the config's image token.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protocol.chat import ChatMessage, ImagePart
from protocol.images import ImageInput
from tokenizer_proc.validation_error import RequestRejected

if TYPE_CHECKING:
    import numpy as np
    from PIL.Image import Image

logger = logging.getLogger(__name__)

IMAGE_TOO_LARGE = "image_too_large"  # the HTTP API answers it with a 413
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
# config.json keys naming the token whose embeddings the vision tower replaces.
_IMAGE_TOKEN_KEYS = ("image_token_id", "image_token_index")
# Model types whose vision tower the worker runs (gpu_worker/models/vision.py lists the same).
VISION_MODEL_TYPES = ("gemma3", "gemma4", "qwen3_5")


@dataclass(frozen=True)
class ImageLimits:
    """What a request's images may be (the tokenizer's flags)."""

    max_images: int = 8  # per request; more is a 400
    max_bytes: int = 20 * 2**20  # one image's file; more is a 413
    max_pixels: int = 40_000_000  # width x height of one decoded image; more is a 413
    local_dir: str | None = None  # ImagePart.path is read only under this directory; None: never


def image_parts(messages: list[ChatMessage]) -> list[tuple[str, ImagePart]]:
    """Every image part of ``messages`` in order, with the field that names it."""
    return [
        (f"messages[{i}].content[{j}]", part)
        for i, m in enumerate(messages)
        for j, part in enumerate(m.parts or [])
        if isinstance(part, ImagePart)
    ]


def read_part(part: ImagePart, param: str, limits: ImageLimits) -> bytes:
    """The image file's bytes: sent inline, or a local file under the allowed directory."""
    if (part.data is None) == (part.path is None):
        raise RequestRejected(param, "needs exactly one of data or path")
    if part.data is not None:
        data = part.data
    else:
        data = _read_local(str(part.path), param, limits)
    if len(data) > limits.max_bytes:
        raise RequestRejected(
            param, f"is {len(data)} bytes, over the limit of {limits.max_bytes}", IMAGE_TOO_LARGE
        )
    return data


def _read_local(path: str, param: str, limits: ImageLimits) -> bytes:
    if limits.local_dir is None:
        raise RequestRejected(
            param, "local image files are not served (the engine runs without --allowed-local-media-path)"
        )
    root = Path(limits.local_dir).resolve()
    file = Path(path.removeprefix("file://")).resolve()
    if not file.is_relative_to(root) or not file.is_file():
        raise RequestRejected(param, f"is no file under the allowed directory {root}")
    if file.stat().st_size > limits.max_bytes:
        raise RequestRejected(param, f"is over the limit of {limits.max_bytes} bytes", IMAGE_TOO_LARGE)
    return file.read_bytes()


def decode_image(data: bytes, param: str, limits: ImageLimits) -> Image:
    """The image in RGB (a GIF's first frame); a file pillow cannot read, of another format, or over
    the pixel limit is refused naming ``param``."""
    from PIL import Image as PilImage

    try:
        image = PilImage.open(io.BytesIO(data))
        if image.format not in FORMATS:
            raise RequestRejected(param, f"is a {image.format} image; send {', '.join(FORMATS)}")
        width, height = image.size
        if width * height > limits.max_pixels:
            raise RequestRejected(
                param, f"is {width}x{height} pixels, over the limit of {limits.max_pixels}", IMAGE_TOO_LARGE
            )
        image.seek(0)  # a GIF's (or an animated WebP's) first frame
        return image.convert("RGB")
    except RequestRejected:
        raise
    except Exception as exc:  # pillow raises many kinds on a bad file; none may end the process
        raise RequestRejected(param, f"could not be decoded as an image: {exc}") from exc


class VisionProcessor:
    """A vision-language model's processor: the rendered chat prompt and its images -> token ids with
    each image's placeholder expanded, and an ``ImageInput`` per image."""

    def __init__(self, processor: Any, image_token_id: int, limits: ImageLimits) -> None:
        self.processor = processor
        self.image_token_id = image_token_id
        self.limits = limits

    @classmethod
    def load(
        cls, model_path: str, limits: ImageLimits, tokenizer: Any = None, mmproj: str | None = None
    ) -> VisionProcessor | None:
        """The model's processor, or None for a model without a vision tower we run. A directory
        without one (a GGUF's) given an mmproj file gets its tower family's, built from the file
        (mmproj_processor.py: Gemma 3, Gemma 4, Qwen3.5)."""
        config_file = Path(model_path) / "config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        if config.get("model_type") not in VISION_MODEL_TYPES or "vision_config" not in config:
            if mmproj is None:
                return None
            from tokenizer_proc.mmproj_processor import mmproj_processor

            processor, image_token = mmproj_processor(mmproj, tokenizer)
            return cls(processor, image_token, limits)
        token = next((config[k] for k in _IMAGE_TOKEN_KEYS if config.get(k) is not None), None)
        if token is None:
            return None
        from transformers import AutoProcessor

        from tokenizer_proc.gemma4_processor import gemma4_processor
        from tokenizer_proc.qwen_processor import qwen_processor

        try:
            loaded: Any
            if config["model_type"] == "gemma4":
                loaded = gemma4_processor(model_path)
            elif config["model_type"] == "qwen3_5":
                loaded, token = qwen_processor(model_path, tokenizer)
            else:
                loaded = AutoProcessor.from_pretrained(model_path)
        except Exception as exc:  # a checkpoint without its processor's files still serves text
            logger.warning("images off: the processor of %s does not load (%s)", model_path, exc)
            return None
        if getattr(loaded, "image_processor", None) is None:
            logger.warning("images off: %s has no image processor", model_path)
            return None
        return cls(loaded, int(token), limits)

    def prompt(self, text: str, messages: list[ChatMessage]) -> tuple[list[int], list[ImageInput]]:
        """Decode the messages' images, run the processor over them and ``text`` (which holds the
        template's placeholder for each), and find each image's run of image tokens."""
        parts = image_parts(messages)
        if len(parts) > self.limits.max_images:
            raise RequestRejected(
                "messages", f"has {len(parts)} images, over the limit of {self.limits.max_images}"
            )
        images = [
            decode_image(read_part(part, param, self.limits), param, self.limits) for param, part in parts
        ]
        try:
            out = self.processor(text=text, images=images, return_tensors="np", add_special_tokens=False)
        except ValueError as exc:  # e.g. the template placed a different number of images
            raise RequestRejected("messages", f"could not be processed with their images: {exc}") from exc
        import numpy as np

        ids = [int(t) for t in out["input_ids"][0]]
        pixels = out["pixel_values"]  # one array of all images, or (Qwen's grids) a list of one each
        pixels = [np.ascontiguousarray(one, dtype=np.float32) for one in pixels]
        if "image_position_ids" in out:  # Gemma 4's padded patches: each one's (x, y) travels with it
            position_ids = out["image_position_ids"].astype(np.float32)
            pixels = [np.concatenate(pair, axis=-1) for pair in zip(pixels, position_ids, strict=True)]
        runs = token_runs(ids, self.image_token_id)
        if len(runs) != len(pixels):
            raise RequestRejected(
                "messages",
                f"hold {len(runs)} runs of image tokens for {len(pixels)} images (image tokens in the text?)",
            )
        delta = getattr(self.processor, "rope_delta", None)  # a multimodal rope's (Qwen's)
        return ids, [
            _image_input(start, length, one, 0 if delta is None else delta(one.shape, length))
            for (start, length), one in zip(runs, pixels, strict=True)
        ]


def token_runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of ``token`` in ``ids``."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def _image_input(start: int, length: int, pixels: np.ndarray, rope_delta: int) -> ImageInput:
    data = pixels.tobytes()
    digest = hashlib.blake2b(data, digest_size=8, person=str(pixels.shape).encode()[:16]).digest()
    key = int.from_bytes(digest, "little") & (2**63 - 1)
    return ImageInput(
        key=key, offset=start, length=length, shape=list(pixels.shape), pixels=data, rope_delta=rope_delta
    )
