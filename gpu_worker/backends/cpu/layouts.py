"""The CPU backend's own weight layouts: GGUF blocks with their rows interleaved by 8.

The C kernels read a type code: the ggml id as the file holds the blocks, or that id | ``X8`` for
the interleaved layout (csrc/quant_x8.c for Q4_0, Q4_1, Q8_0; csrc/quant_kx8.c for Q4_K, Q5_K,
Q6_K; csrc/quant_sub32x8.c for Q5_0, Q5_1, IQ4_NL, IQ4_XS; csrc/quant_k23x8.c for Q2_K, Q3_K;
csrc/quant_mxfp4.c for MXFP4). The loader keeps the file's bytes (weights/formats.py); the
backend re-lays them here when it prepares the model: the same bytes, rearranged, for every weight
whose rows are a multiple of 8.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from gpu_worker.weights.formats import FILE_LAYOUT, SIXTEEN_BIT_TYPES, QuantBlocks, dequantize_blocks

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
# csrc/quant_kx8.c: an interleaved K-quant met by 8-bit activations (csrc/quant.h's act_block8), the
# many-row path where the build has it (quant.py's A8_MIN_ROWS): a flag on the type code of a call.
A8 = 0x200
# ggml Q4_0, Q4_1, Q8_0 -> bytes of fp16 scales a block starts with; MXFP4 (csrc/quant_mxfp4.c, the
# same chunks of quant bytes) -> its one exponent byte
INTERLEAVED_TYPES = {2: 2, 3: 4, 8: 2, 39: 1}


def interleaves(blocks: QuantBlocks) -> bool:
    """Whether ``interleave_rows`` re-lays these blocks (rather than returning them as they are)."""
    return blocks.layout == FILE_LAYOUT and blocks.rows % 8 == 0 and blocks.type in X8_TYPES


def interleave_rows(blocks: QuantBlocks, out: torch.Tensor | None = None) -> QuantBlocks:
    """The layout csrc/quant_x8.c (legacy types) or csrc/quant_kx8.c (K-quants) reads, their top
    comments draw it: per group of 8 rows and block, the 8 rows' fields side by side (the legacy
    types' quant bytes 2 per row in turn, the K-quants' 4). Same bytes; for rows a multiple of 8
    (others, and other types, are returned as they are). ``out``: where to write them (uint8 of the
    blocks' shape, contiguous; hugepages.py's arena), else a new tensor."""
    if not interleaves(blocks):
        return blocks
    return QuantBlocks(
        blocks.type, _permute_groups(blocks, _group_order(blocks.type), out=out), blocks.cols, X8_LAYOUT
    )


def in_arena(blocks: QuantBlocks) -> bool:
    """Whether the backend holds these blocks in its huge-page arena (hugepages.py): those
    ``interleave_rows`` re-lays, and F16 / BF16 rows as the file holds them, copied there as they are
    (csrc/quant_f16.c's one-row tile streams them front to back, at the memory's pace on 2 MB pages;
    on the file's mapping, 4 KB pages, it falls well behind: docs/benchmarks-history.md, "BF16 and
    F16 one row: a sequential stream on huge pages")."""
    return interleaves(blocks) or (blocks.layout == FILE_LAYOUT and blocks.type in SIXTEEN_BIT_TYPES)


def place(blocks: QuantBlocks, out: torch.Tensor) -> QuantBlocks:
    """Blocks for which ``in_arena`` holds, written to ``out`` (uint8 of their shape, an arena's) in the
    layout the backend reads: interleaved where ``interleave_rows`` re-lays them, else as they are."""
    if interleaves(blocks):
        return interleave_rows(blocks, out)
    out.copy_(blocks.data)
    return QuantBlocks(blocks.type, out, blocks.cols, blocks.layout)


def deinterleave_rows(blocks: QuantBlocks) -> torch.Tensor:
    """``interleave_rows`` undone: the file's [rows, row_bytes] blocks."""
    return _permute_groups(blocks, np.argsort(_group_order(blocks.type)), back=True)


# csrc/quant_kx8.c: the K-quants (ggml Q4_K, Q5_K, Q6_K -> bytes of a 256-weight block), rows
# interleaved by 8: each group block (the 8 rows' block b) is the 8 file blocks' bytes in the order
# _k_order gives.
K_BLOCK_BYTES = {12: 144, 13: 176, 14: 210}
X8_TYPES = frozenset(INTERLEAVED_TYPES) | frozenset(K_BLOCK_BYTES)  # the types interleave_rows re-lays
_BLOCK_BYTES = {2: 18, 3: 20, 8: 34, 39: 17} | K_BLOCK_BYTES  # of one file block, per ggml type

# csrc/quant_sub32x8.c: Q5_0, Q5_1, IQ4_NL (ggml 6, 7, 20 -> bytes of fp16 d [, m] a block starts
# with; the Q5 types' 4 bytes of fifth bits follow, then 16 of nibbles), rows interleaved by 8 as
# _sub32_order gives.
SUB32_HEAD_BYTES = {6: 2, 7: 4, 20: 2}
X8_TYPES |= frozenset(SUB32_HEAD_BYTES) | {23}  # and IQ4_XS (ggml 23), as _iq4_xs_order gives
_BLOCK_BYTES |= {6: 22, 7: 24, 20: 18, 23: 136}
# csrc/quant_k23x8.c: Q2_K, Q3_K (ggml 10, 11) -> per field (its offset in the file's block, bytes a
# slot, chunks), in the group block's order: the 8 rows' d [and dmin], then each field in chunks.
K23_FIELDS = {
    10: ((80, 2, 1), (82, 2, 1), (0, 4, 4), (16, 4, 16)),  # d, dmin, scales, quants
    11: ((108, 2, 1), (96, 4, 3), (0, 4, 8), (32, 4, 16)),  # d, scales, high bits, quants
}
X8_TYPES |= frozenset(K23_FIELDS)
_BLOCK_BYTES |= {10: 84, 11: 110}


@functools.cache
def _group_order(ggml_type: int) -> np.ndarray:
    """For each byte of a group block (the 8 rows' block b, interleaved), which byte of the 8 file
    blocks [slot, byte] (flattened) it is."""
    if ggml_type in K_BLOCK_BYTES:
        return _k_order(ggml_type)
    if ggml_type in SUB32_HEAD_BYTES:
        return _sub32_order(ggml_type)
    if ggml_type == 23:
        return _iq4_xs_order()
    if ggml_type in K23_FIELDS:
        return _k23_order(ggml_type)
    head, bb = INTERLEAVED_TYPES[ggml_type], _BLOCK_BYTES[ggml_type]
    at = np.arange(8 * bb).reshape(8, bb)  # the scales 2 bytes (MXFP4: 1) per slot in turn, then the quants
    scales = at[:, :head].reshape(8, -1, min(head, 2)).transpose(1, 0, 2)
    quants = at[:, head:].reshape(8, -1, 2).transpose(1, 0, 2)
    return np.concatenate([scales.reshape(-1), quants.reshape(-1)])


@functools.cache
def _k_order(ggml_type: int) -> np.ndarray:
    """For each byte of a group block, which byte of the 8 file blocks [slot, byte] (flattened) it
    is: the fields of csrc/quant_kx8.c's top comment, in its order."""
    bb = K_BLOCK_BYTES[ggml_type]
    at = np.arange(8 * bb).reshape(8, bb)

    def chunks(lo: int, hi: int, *shape: int) -> np.ndarray:  # bytes [lo, hi) of each slot, 4 at a time
        return np.moveaxis(at[:, lo:hi].reshape(8, *shape, 4), 0, -2)  # [..., slot, 4]

    if ggml_type == 14:  # Q6_K: d | scales (h, half, pair, sub-block of the pair, slot) | ql | qh
        scales = at[:, 192:208].reshape(8, 2, 2, 2, 2).transpose(1, 4, 2, 3, 0)  # file: [h][2p + q][half]
        fields = [at[:, 208:210], scales, chunks(0, 128, 2, 2, 8), chunks(128, 192, 2, 8)]
    else:  # Q4_K / Q5_K: d | dmin | 3 scale words | (Q5_K: qh) | qs
        qh = [chunks(16, 48, 8)] if ggml_type == 13 else []
        qs_at = 48 if ggml_type == 13 else 16
        fields = [at[:, 0:2], at[:, 2:4], chunks(4, 16, 3), *qh, chunks(qs_at, qs_at + 128, 4, 8)]
    order = np.concatenate([f.reshape(-1) for f in fields])
    assert sorted(order.tolist()) == list(range(8 * bb)), "every byte once"
    return order


@functools.cache
def _sub32_order(ggml_type: int) -> np.ndarray:
    """Q5_0 / Q5_1 / IQ4_NL's group block (csrc/quant_sub32x8.c's top comment): the 8 rows' d [and m]
    2 bytes each, the Q5 types' qh by byte (byte j of rows 0-7, then byte j + 1), the quants in chunks
    of 4 bytes a row."""
    head = SUB32_HEAD_BYTES[ggml_type]
    at = np.arange(8 * _BLOCK_BYTES[ggml_type]).reshape(8, -1)
    scales = at[:, :head].reshape(8, head // 2, 2).transpose(1, 0, 2)
    quants = at[:, -16:].reshape(8, 4, 4).transpose(1, 0, 2)
    return np.concatenate([scales.reshape(-1), at[:, head:-16].T.reshape(-1), quants.reshape(-1)])


@functools.cache
def _iq4_xs_order() -> np.ndarray:
    """IQ4_XS's group block (csrc/quant_sub32x8.c's top comment): the 8 rows' d, scale highs (2 bytes
    each) and lows (4 each), then per 32-weight sub-block its 16 nibble bytes in chunks of 4 a row."""
    at = np.arange(8 * 136).reshape(8, 136)
    quants = at[:, 8:].reshape(8, 8, 4, 4).transpose(1, 2, 0, 3)  # [sub-block, chunk, slot, 4]
    heads = [at[:, 0:2], at[:, 2:4], at[:, 4:8]]  # d, scale highs, scale lows
    return np.concatenate([*(h.reshape(-1) for h in heads), quants.reshape(-1)])


@functools.cache
def _k23_order(ggml_type: int) -> np.ndarray:
    """Q2_K / Q3_K's group block (csrc/quant_k23x8.c's top comment): per field, chunk c of slot s at
    (8c + s) units."""
    at = np.arange(8 * _BLOCK_BYTES[ggml_type]).reshape(8, -1)
    fields = [at[:, o : o + u * n].reshape(8, n, u).transpose(1, 0, 2) for o, u, n in K23_FIELDS[ggml_type]]
    return np.concatenate([f.reshape(-1) for f in fields])


def _permute_groups(
    blocks: QuantBlocks, order: np.ndarray, back: bool = False, out: torch.Tensor | None = None
) -> torch.Tensor:
    """[rows, row_bytes] with each group block's bytes taken in ``order`` (rows the slots of their
    group, blocks in turn), written to ``out`` if given; ``back``: from the interleaved layout to the
    file's. torch's byte gather over [group blocks, 8 * block bytes] (multi-threaded; numpy's fancy
    indexing was most of a 1B Q4_K_M model's start-up: ``python -m bench.startup``)."""
    n, row_bytes = blocks.data.shape
    bb = _BLOCK_BYTES[blocks.type]
    nb = row_bytes // bb
    index = torch.from_numpy(order.astype(np.int64))
    x = blocks.data
    if back:
        back_out = x.reshape(n // 8 * nb, 8 * bb)[:, index].view(n // 8, nb, 8, bb).transpose(1, 2)
        return back_out.reshape(n, row_bytes)
    groups = x.view(n // 8, 8, nb, bb).transpose(1, 2).reshape(n // 8 * nb, 8 * bb)
    out = torch.empty((n, row_bytes), dtype=torch.uint8) if out is None else out
    # gather with a broadcast index: several times faster than indexing groups[:, index]
    # (docs/benchmarks-history.md, "Numbers behind the code's choices")
    torch.gather(groups, 1, index.expand(groups.shape[0], -1), out=out.view(n // 8 * nb, 8 * bb))
    return out
