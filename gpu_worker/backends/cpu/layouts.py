"""The CPU backend's own weight layouts: the legacy GGUF types with their rows interleaved by 8.

The C kernels read a type code: the ggml id as the file holds the blocks, or that id | ``X8`` for
the interleaved layout (csrc/quant_x8.c). The loader keeps the file's bytes (weights/formats.py);
the backend re-lays them here when it prepares the model.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.weights.formats import FILE_LAYOUT, QuantBlocks, dequantize_blocks

X8_LAYOUT = "x8"


def kernel_type(blocks: QuantBlocks) -> int:
    """The type code the C kernels take: the ggml id, | X8 for the interleaved layout."""
    return blocks.type | X8 if blocks.layout == X8_LAYOUT else blocks.type


def dequantize(blocks: QuantBlocks) -> torch.Tensor:
    """float32 [rows, cols] of blocks in either layout."""
    data = deinterleave_rows(blocks) if blocks.layout == X8_LAYOUT else blocks.data
    return dequantize_blocks(blocks.type, data.numpy(), (blocks.rows, blocks.cols))


# csrc/quant_x8.c: the legacy 32-weight types, rows interleaved by 8 (a flag on the type code).
X8 = 0x100
INTERLEAVED_TYPES = {2: 2, 3: 4, 8: 2}  # ggml Q4_0, Q4_1, Q8_0 -> bytes of fp16 scales a block starts with


def interleave_rows(blocks: QuantBlocks) -> QuantBlocks:
    """The layout csrc/quant_x8.c reads (its top comment draws it): per group of 8 rows and block,
    the 8 rows' fp16 d (and Q4_1's m), then their quant bytes 2 per row in turn. Same bytes; for the
    legacy types with rows a multiple of 8 (others are returned as they are)."""
    head = INTERLEAVED_TYPES.get(blocks.type)
    if head is None or blocks.layout != FILE_LAYOUT or blocks.rows % 8:
        return blocks
    n, row_bytes = blocks.data.shape
    nb = blocks.cols // 32
    x = blocks.data.numpy().reshape(n // 8, 8, nb, row_bytes // nb)  # [group, slot, block, byte]
    scales = x[..., :head].reshape(n // 8, 8, nb, head // 2, 2).transpose(0, 2, 3, 1, 4)
    quants = x[..., head:].reshape(n // 8, 8, nb, -1, 2).transpose(0, 2, 3, 1, 4)
    out = np.concatenate([scales.reshape(n // 8, nb, -1), quants.reshape(n // 8, nb, -1)], axis=2)
    data = torch.from_numpy(np.ascontiguousarray(out).reshape(n, row_bytes))
    return QuantBlocks(blocks.type, data, blocks.cols, layout=X8_LAYOUT)


def deinterleave_rows(blocks: QuantBlocks) -> torch.Tensor:
    """``interleave_rows`` undone: the file's [rows, row_bytes] blocks."""
    head = INTERLEAVED_TYPES[blocks.type]
    n, row_bytes = blocks.data.shape
    nb = blocks.cols // 32
    x = blocks.data.numpy().reshape(n // 8, nb, row_bytes // nb * 8)
    scales = x[..., : 8 * head].reshape(n // 8, nb, head // 2, 8, 2).transpose(0, 3, 1, 2, 4)
    quants = x[..., 8 * head :].reshape(n // 8, nb, -1, 8, 2).transpose(0, 3, 1, 2, 4)
    out = np.concatenate([scales.reshape(n // 8, 8, nb, head), quants.reshape(n // 8, 8, nb, -1)], axis=3)
    return torch.from_numpy(np.ascontiguousarray(out).reshape(n, row_bytes))
