"""An image on its way from the tokenizer process (which decoded and processed it) through the
scheduler (which keys the prefix cache by it) to the worker (which encodes it into embeddings)."""

# mypy: disable-error-code="misc"

from __future__ import annotations

from protocol.base import Msg


class ImageInput(Msg):
    """One image of a prompt: the model's processor's pixels for it, and where its tokens sit.

    ``offset`` and ``length``: the run of image tokens in the prompt (``input_ids[offset : offset +
    length]``) whose embeddings the vision tower gives. ``key``: a hash of the pixels (63 bits); the
    radix cache keys those positions by it, the worker caches the tower's output under it.
    ``pixels``: float32, C order, of ``shape`` (the processor's pixel_values for this image).
    ``rope_delta``: a multimodal rope's (Qwen's) position span of the image minus its token count,
    by which every token after it is off its index (HF's ``rope_deltas``); 0 for 1D rope.
    """

    key: int
    offset: int
    length: int
    shape: list[int]
    pixels: bytes
    rope_delta: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.length

    def cache_key(self) -> int:
        """The value the radix cache sees at each of its positions: negative, so never a token id
        (PENDING is -1)."""
        return -2 - self.key
