"""Random GGUF blocks of a sane size for the bench's files (bench/lib/gguf_models.py) and the kernel
benches: random quants with per-block scales that give zero-mean weights of about the asked std, so
the hidden states stay finite through every layer. gguf-py cannot quantize K-quants or IQ types;
random bytes with chosen scales are what the benches need of them (the output is noise)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
IQ4_RMS = 67.4  # the root mean square of the IQ4 types' 16 levels (-127 .. 113)


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator, std: float = 0.02) -> np.ndarray:
    """uint8 [rows, row bytes] of ``qtype`` (or of BF16 / F16 values): random quants, scales that make
    zero-mean weights of about ``std`` (each block's scale varied by +-25%)."""
    if qtype in (Q.BF16, Q.F16):
        return _sixteen_bit(qtype, rng.normal(0.0, std, size=(rows, cols)).astype(np.float32))
    size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    nb = rows * cols // size
    blocks = rng.integers(0, 256, size=(nb, block_bytes), dtype=np.uint8)
    jitter = rng.uniform(0.75, 1.25, size=nb)

    def put_f16(at: int, values: np.ndarray) -> None:
        blocks[:, at : at + 2] = values.astype(np.float16).view(np.uint8).reshape(nb, 2)

    if qtype in (Q.Q4_K, Q.Q5_K):
        # 6-bit scales sc = m in [32, 63]: weight = d sc q - dmin m, q uniform on [0, 2^bits);
        # dmin = d (2^bits - 1) / 2 centres each sub-block.
        levels = 16 if qtype == Q.Q4_K else 32
        sc = rng.integers(32, 64, size=(nb, 8), dtype=np.uint8)
        packed = np.zeros((nb, 12), dtype=np.uint8)
        packed[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)  # sc 0-3, high bits of sc 4-7
        packed[:, 4:8] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)  # m = sc
        packed[:, 8:12] = (sc[:, 4:8] & 15) | ((sc[:, 4:8] & 15) << 4)
        blocks[:, 4:16] = packed
        d = std / (48 * levels / 12**0.5) * jitter
        put_f16(0, d)
        put_f16(2, d * (levels - 1) / 2)
    elif qtype == Q.Q6_K:  # weight = d scale (q - 32), q uniform on [0, 64), int8 scales in [64, 127]
        blocks[:, 192:208] = rng.integers(64, 128, size=(nb, 16), dtype=np.uint8)
        put_f16(208, std / (96 * 64 / 12**0.5) * jitter)
    elif qtype == Q.Q8_0:  # weight = d q, q uniform on [-128, 128)
        put_f16(0, std / (256 / 12**0.5) * jitter)
    elif qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):  # d (q - 2^bits / 2), or d q + m, m = -(2^bits - 1) / 2 d
        levels = 16 if qtype in (Q.Q4_0, Q.Q4_1) else 32
        d = std / (levels / 12**0.5) * jitter
        put_f16(0, d)
        if qtype in (Q.Q4_1, Q.Q5_1):
            put_f16(2, -(levels - 1) / 2 * d)
    elif qtype == Q.IQ4_NL:  # d V[q]: a random sign per block centres the levels' mean (-5.9)
        put_f16(0, std / IQ4_RMS * jitter * rng.choice([-1.0, 1.0], size=nb))
    elif qtype == Q.IQ4_XS:
        _iq4_xs_scales(blocks, rng)
        put_f16(0, std / (IQ4_RMS * 24.0) * jitter * rng.choice([-1.0, 1.0], size=nb))
    elif qtype == Q.Q2_K:  # d sc q - dmin m, q uniform on [0, 4), sc = m in [8, 15], dmin = 1.5 d
        sc = rng.integers(8, 16, size=(nb, 16), dtype=np.uint8)
        blocks[:, :16] = sc | (sc << 4)
        d = std / (11.5 * 1.118) * jitter
        put_f16(80, d)
        put_f16(82, 1.5 * d)
    elif qtype == Q.Q3_K:  # d (s - 32) q, q uniform on [-4, 4), s uniform on [0, 64): rms ~18.5 x 2.29
        put_f16(108, std / (18.5 * 2.29) * jitter)
    else:
        raise ValueError(f"no random blocks for {qtype.name}")
    return blocks.reshape(rows, -1)


def _iq4_xs_scales(blocks: np.ndarray, rng: np.random.Generator) -> None:
    """Each 32's 6-bit scale ls in [48, 63] (ls - 32: 16 .. 31, rms ~24), packed as IQ4_XS holds them:
    low nibbles two a byte at 4..7, high 2 bits in the 16 bits at 2..3."""
    ls = rng.integers(48, 64, size=(len(blocks), 8), dtype=np.uint16)
    high = np.zeros(len(blocks), dtype=np.uint16)
    for i in range(8):
        high |= (ls[:, i] >> 4) << (2 * i)
    blocks[:, 2:4] = high.view(np.uint8).reshape(-1, 2)
    blocks[:, 4:8] = ((ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)).astype(np.uint8)


def _sixteen_bit(qtype: Q, w: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] as BF16 (rounded to nearest even) or F16 bytes, uint8 [rows, 2 cols]."""
    if qtype == Q.F16:
        return w.astype(np.float16).view(np.uint8)
    bits = w.view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16).view(np.uint8)


def declare_tensors(
    writer: gguf.GGUFWriter, tensors: Sequence[tuple[str, Q | None, tuple[int, ...]]]
) -> None:
    """Declare ``tensors`` (float32 where the type is None, else blocks held as [rows, row bytes])
    and write the header, the metadata and the tensor infos: their data follow, in this order."""
    for name, qtype, dims in tensors:
        if qtype is None:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), math.prod(dims) * 4)
        else:
            size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            row_bytes = dims[-1] // size * block_bytes
            nbytes = math.prod(dims[:-1]) * row_bytes
            writer.add_tensor_info(name, (*dims[:-1], row_bytes), np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
