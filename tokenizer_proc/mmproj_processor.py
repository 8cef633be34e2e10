"""An image processor for a model whose directory has none (a GGUF's), built from its llama.cpp
mmproj file (``--mmproj``): the sizes, mean and std from the file's ``clip.*`` metadata, transformers'
image processor of the tower's family for the pixels, and that family's placeholder expansion over
the model's own tokenizer, whose vocabulary holds the image tokens.

Gemma 3 (``gemma3``): ``\\n\\n<start_of_image>`` + ``<image_soft_token>`` x tokens-per-image +
``<end_of_image>\\n\\n``, as HF's Gemma3Processor writes it. Gemma 4 (``gemma4v``) and Qwen3.5
(``qwen3vl_merger``): gemma4_processor.py's and qwen_processor.py's expansions. What the file does not
carry, the patch budgets, is taken as the released checkpoints' processor configs set it.
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


# The released checkpoints' processor settings that an mmproj file does not carry.
GEMMA4_MAX_SOFT_TOKENS = 280  # Gemma 4's image_seq_length
GEMMA4_TOKENS = ("<|image|>", "<|image>", "<image|>")  # image, begin, end
QWEN35_PIXELS = {"shortest_edge": 65536, "longest_edge": 16777216}  # Qwen3-VL / Qwen3.5's size


def mmproj_processor(mmproj: str, tokenizer: PreTrainedTokenizerBase) -> tuple[Any, int]:
    """The processor and the image token id; ValueError for a file or tokenizer we cannot serve."""
    from gguf import GGUFReader

    reader = GGUFReader(mmproj)
    fields = {name: field.contents() for name, field in reader.fields.items() if name.startswith("clip.")}
    projector = fields.get("clip.projector_type") or fields.get("clip.vision.projector_type")  # Gemma 4's
    if projector == "gemma3":
        return _gemma3(fields, tokenizer)
    if projector == "gemma4v":
        return _gemma4(fields, tokenizer)
    if projector == "qwen3vl_merger":
        return _qwen35(fields, tokenizer)
    raise ValueError(f"{mmproj}: projector type {projector!r} (supported: gemma3, gemma4v, qwen3vl_merger)")


def _token_ids(tokenizer: PreTrainedTokenizerBase, tokens: tuple[str, ...], family: str) -> list[int]:
    ids = [tokenizer.convert_tokens_to_ids(token) for token in tokens]
    if any(not isinstance(i, int) or i == tokenizer.unk_token_id for i in ids):
        raise ValueError(f"the model's tokenizer lacks {family}'s image tokens {', '.join(tokens)}")
    return [int(i) for i in ids]  # type: ignore[arg-type]


def _normalization(fields: dict[str, Any]) -> dict[str, Any]:
    v = "clip.vision."
    return {
        "image_mean": [float(x) for x in fields[v + "image_mean"]],
        "image_std": [float(x) for x in fields[v + "image_std"]],
    }


def _gemma3(fields: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> tuple[MmprojGemma3Processor, int]:
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    image_token = _token_ids(tokenizer, (BOI, EOI, IMAGE), "Gemma 3")[2]
    size, patch = int(fields["clip.vision.image_size"]), int(fields["clip.vision.patch_size"])
    per_side = size // patch // int(fields.get("clip.vision.projector.scale_factor", DEFAULT_SCALE_FACTOR))
    image_processor = Gemma3ImageProcessorPil(size={"height": size, "width": size}, **_normalization(fields))
    return MmprojGemma3Processor(image_processor, tokenizer, per_side**2), image_token


def _gemma4(fields: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> tuple[Any, int]:
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from tokenizer_proc.gemma4_processor import Gemma4ImageProcessor

    image_token = _token_ids(tokenizer, GEMMA4_TOKENS, "Gemma 4")[0]
    image_processor = Gemma4ImageProcessorPil(
        patch_size=int(fields["clip.vision.patch_size"]),
        pooling_kernel_size=int(fields.get("clip.vision.projector.scale_factor", 3)),
        max_soft_tokens=GEMMA4_MAX_SOFT_TOKENS,
        **_normalization(fields),
    )
    return Gemma4ImageProcessor(image_processor, tokenizer, GEMMA4_TOKENS), image_token


def _qwen35(fields: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> tuple[Any, int]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tokenizer_proc.qwen_processor import IMAGE as QWEN_IMAGE
    from tokenizer_proc.qwen_processor import QwenImageProcessor

    image_token = _token_ids(tokenizer, (QWEN_IMAGE,), "Qwen")[0]
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=int(fields["clip.vision.patch_size"]),
        merge_size=int(fields.get("clip.vision.spatial_merge_size", 2)),
        temporal_patch_size=2,
        size=dict(QWEN35_PIXELS),
        **_normalization(fields),
    )
    return QwenImageProcessor(image_processor, tokenizer), image_token
