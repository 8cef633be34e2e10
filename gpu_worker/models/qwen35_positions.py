"""Qwen3.5's multimodal rope positions: three per token (time, row, column), as HF's
Qwen3_5Model.get_rope_index gives them.

Text tokens get their running index on all three axes (which makes their rope plain 1D rope). An
image's run of tokens, its merged grid ``t x h x w`` in row-major order, gets ``start + (frame, row,
column)`` where ``start`` is the running index at the image; the text after it resumes at ``start +
max(h, w)``, not at ``start + t * h * w``. A prompt's ``delta`` (its largest position + 1 minus its
length, HF's ``rope_deltas``) is what every later token's position is off from its index: a decode
step at sequence index ``i`` is at ``i + delta`` on all three axes.

The language model's rope is interleaved over the three axes (``mrope_section`` [t, h, w]
frequencies): of the rotated half's frequencies, every third from the second takes the row position
(the first ``3 * h`` of them), every third from the third the column (the first ``3 * w``), the rest
the time position.

An image's grid comes from its pixels' shape, ``[t, h, w, patch]`` in patches
(gpu_worker/models/qwen35_vision.py); the tokens' grid is the patches' over the merge size.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch

from gpu_worker.models.layers import RotaryCache
from protocol.images import ImageInput
from protocol.worker_messages import ForwardBatch


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


def mrope_axes(rotary_dim: int, sections: Sequence[int]) -> torch.Tensor:
    """[rotary_dim]: which position (0 time, 1 row, 2 column) each cos/sin column rotates by."""
    half = torch.arange(rotary_dim // 2)
    axes = torch.zeros_like(half)
    for axis in (1, 2):
        axes[(half % 3 == axis) & (half < 3 * sections[axis])] = axis
    return torch.cat((axes, axes))


def mrope_cos_sin(
    cache: RotaryCache, positions: torch.Tensor, sections: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed sin [T, 1, rotary_dim] of [3, T] positions (a 1D RotaryCache's rows, per column
    the row of that column's axis): the same numbers HF's multimodal rope gives."""
    axes = mrope_axes(cache.cos.shape[-1], sections).to(positions.device)
    flat = positions.reshape(-1)
    cos = cache.cos.index_select(0, flat).view(3, -1, cache.cos.shape[-1])
    sin = cache.sin.index_select(0, flat).view(3, -1, cache.sin.shape[-1])
    pick = axes.view(1, 1, -1).expand(1, cos.shape[1], -1)
    return cos.gather(0, pick)[0].unsqueeze(1), sin.gather(0, pick)[0].unsqueeze(1)


def batch_positions(
    positions: torch.Tensor, batch: ForwardBatch, merge: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The batch's 1D positions moved by each row's multimodal offset (its ``rope_offsets`` and the
    ``rope_delta`` of each image ending inside it), which is every text token's position on all
    three axes; and the [3, T] positions when some row has image tokens (None: none has)."""
    if not batch.rope_offsets and not batch.images:
        return positions, None
    starts = list(accumulate(batch.extend_lens, initial=0))
    shift = torch.zeros(starts[-1], dtype=torch.int64)
    for row, offset in enumerate(batch.rope_offsets):
        shift[starts[row] : starts[row + 1]] = offset
    # Each image's start position, before its own delta moves the tokens after it.
    image_starts: list[int] = []
    for row, image in zip(batch.image_rows, batch.images, strict=True):
        first = batch.prefix_lens[row]
        lo = starts[row] + max(image.offset, first) - first
        image_starts.append(image.offset + int(shift[lo]))
        if image.end < first + batch.extend_lens[row]:
            shift[starts[row] + image.end - first : starts[row + 1]] += image.rope_delta
    moved = positions + shift.to(positions.device, positions.dtype)
    if not batch.images:
        return moved, None
    grid = moved.expand(3, -1).clone()
    for row, image, start in zip(batch.image_rows, batch.images, image_starts, strict=True):
        first, end = batch.prefix_lens[row], batch.prefix_lens[row] + batch.extend_lens[row]
        lo, hi = max(image.offset, first), min(image.end, end)
        tokens = image_positions(start, image.shape, merge)[:, lo - image.offset : hi - image.offset]
        flat = starts[row] + lo - first
        grid[:, flat : flat + hi - lo] = tokens.to(grid.device, grid.dtype)
    return moved, grid
