"""A Gemma 3 image processor for a model whose directory has none (a GGUF's), built from its
llama.cpp mmproj file (``--mmproj``): the image size, mean and std from the file's ``clip.*``
metadata, transformers' Gemma 3 image processor for the pixels, and Gemma 3's placeholder expansion
(``\\n\\n<start_of_image>`` + ``<image_soft_token>`` x tokens-per-image + ``<end_of_image>\\n\\n``,
as HF's Gemma3Processor writes it) over the model's own tokenizer, whose vocabulary holds those tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

BOI, EOI, IMAGE = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
DEFAULT_SCALE_FACTOR = 4  # as gpu_worker/weights/mmproj.py reads the file


class MmprojGemma3Processor:
    """Called as transformers' processors are: text with one ``<start_of_image>`` per image."""

    def __init__(
        self, image_processor: Any, tokenizer: PreTrainedTokenizerBase, tokens_per_image: int
    ) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.full_image = f"\n\n{BOI}{IMAGE * tokens_per_image}{EOI}\n\n"

    def __call__(self, *, text: str, images: list[Any], **_: Any) -> dict[str, Any]:
        import numpy as np

        if text.count(BOI) != len(images):
            raise ValueError(f"the prompt places {text.count(BOI)} images for {len(images)} sent")
        ids = self.tokenizer.encode(text.replace(BOI, self.full_image), add_special_tokens=False)
        pixels = self.image_processor(images, return_tensors="np")["pixel_values"]
        return {"input_ids": np.asarray([ids]), "pixel_values": pixels}


def mmproj_processor(mmproj: str, tokenizer: PreTrainedTokenizerBase) -> tuple[MmprojGemma3Processor, int]:
    """The processor and the image token id; ValueError for a file or tokenizer that is not Gemma 3's."""
    from gguf import GGUFReader
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    reader = GGUFReader(mmproj)
    fields = {name: field.contents() for name, field in reader.fields.items() if name.startswith("clip.")}
    if fields.get("clip.projector_type") != "gemma3":
        raise ValueError(
            f"{mmproj}: projector type {fields.get('clip.projector_type')!r} (supported: gemma3)"
        )
    ids = [tokenizer.convert_tokens_to_ids(token) for token in (BOI, EOI, IMAGE)]
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise ValueError(f"the model's tokenizer lacks Gemma 3's image tokens {BOI}, {EOI}, {IMAGE}")
    size, patch = int(fields["clip.vision.image_size"]), int(fields["clip.vision.patch_size"])
    per_side = size // patch // int(fields.get("clip.vision.projector.scale_factor", DEFAULT_SCALE_FACTOR))
    image_processor = Gemma3ImageProcessorPil(
        size={"height": size, "width": size},
        image_mean=[float(x) for x in fields["clip.vision.image_mean"]],
        image_std=[float(x) for x in fields["clip.vision.image_std"]],
    )
    image_token = ids[2]
    assert isinstance(image_token, int), "one token's id"
    return MmprojGemma3Processor(image_processor, tokenizer, per_side**2), image_token
