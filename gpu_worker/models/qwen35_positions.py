"""Qwen3.5's multimodal rope positions: three per token (time, row, column), as HF's
Qwen3_5Model.get_rope_index gives them.

Text tokens get their running index on all three axes (which makes their rope plain 1D rope). An
image's run of tokens, its merged grid ``t x h x w`` in row-major order, gets ``start + (frame, row,
column)`` where ``start`` is the running index at the image; the text after it resumes at ``start +
max(h, w)``, not at ``start + t * h * w``. A prompt's ``delta`` (its largest position + 1 minus its
length, HF's ``rope_deltas``) is what every later token's position is off from its index: a decode
step at sequence index ``i`` is at ``i + delta`` on all three axes.

An image's grid comes from its pixels' shape, ``[t, h, w, patch]`` in patches
(gpu_worker/models/qwen35_vision.py); the tokens' grid is the patches' over the merge size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from protocol.images import ImageInput


def image_positions(start: int, shape: Sequence[int], merge: int) -> torch.Tensor:
    """[3, t * h * w]: an image's tokens' (time, row, column) positions from ``start``."""
    t, h, w = shape[0], shape[1] // merge, shape[2] // merge
    grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack(grid).reshape(3, -1) + start


def prompt_positions(length: int, images: Sequence[ImageInput], merge: int) -> tuple[torch.Tensor, int]:
    """([3, length] positions, delta) of a prompt of ``length`` tokens whose image runs are
    ``images`` (in order, not overlapping)."""
    parts: list[torch.Tensor] = []
    index = position = 0  # the next token's index in the prompt, and its position
    for image in sorted(images, key=lambda image: image.offset):
        text = image.offset - index
        parts.append(torch.arange(text).expand(3, -1) + position)
        position += text
        tokens = image_positions(position, image.shape, merge)
        if tokens.shape[1] != image.length:
            raise ValueError(f"image {image.key}: {image.length} tokens for a grid of {tokens.shape[1]}")
        parts.append(tokens)
        position += max(image.shape[1], image.shape[2]) // merge
        index = image.end
    parts.append(torch.arange(length - index).expand(3, -1) + position)
    positions = torch.cat(parts, dim=1)
    return positions, int(positions.max()) + 1 - length if length else 0


def decode_positions(indices: torch.Tensor, delta: int) -> torch.Tensor:
    """[3, N]: the positions of tokens at sequence ``indices`` after the prompt (or after its last
    image), which are ``index + delta`` on every axis."""
    return (indices + delta).expand(3, -1)
