"""Weights to GGUF blocks for the tests' files, where gguf-py cannot quantize the type itself (it
dequantizes every type but quantizes few): IQ4_NL and IQ4_XS here, nearest level at a scale from
each block's largest weight, as simple as a test model needs (llama.cpp's quantizer searches the
scale; a file's bytes decode the same either way). Q2_K and Q3_K: random blocks of the weights' spread
(bench/lib/gguf_blocks.py), so a test's model holds the file's values, not the ones it was given."""

from __future__ import annotations

import gguf
import numpy as np

from bench.lib.gguf_blocks import random_blocks

Q = gguf.GGMLQuantizationType
IQ4_LEVELS = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32
)


def quantize(w: np.ndarray, qtype: Q) -> np.ndarray:
    """``w`` [..., k] (float32) in ``qtype``'s blocks: gguf-py's quantization, or ours for IQ4_NL and
    IQ4_XS. uint8 [..., row bytes]."""
    if qtype == Q.IQ4_NL:
        return _iq4_nl(w.astype(np.float32))
    if qtype == Q.IQ4_XS:
        return _iq4_xs(w.astype(np.float32))
    if qtype in (Q.Q2_K, Q.Q3_K):  # random blocks of w's spread: the file then holds other weights
        rows = int(np.prod(w.shape[:-1]))
        blocks = random_blocks(qtype, rows, w.shape[-1], np.random.default_rng(rows), float(w.std()))
        return blocks.reshape(*w.shape[:-1], -1)
    return gguf.quants.quantize(w, qtype)


def _signed_max(b: np.ndarray) -> np.ndarray:
    """Per block (last axis) the weight of largest magnitude, with its sign."""
    return np.take_along_axis(b, np.abs(b).argmax(axis=-1, keepdims=True), axis=-1)[..., 0]


def _nibbles(scaled: np.ndarray) -> np.ndarray:
    """[..., 32] values in level units -> the 16 bytes ggml packs them in (low nibbles: weights 0-15)."""
    q = np.abs(scaled[..., None] - IQ4_LEVELS).argmin(axis=-1).astype(np.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def _iq4_nl(w: np.ndarray) -> np.ndarray:
    lead, k = w.shape[:-1], w.shape[-1]
    b = w.reshape(-1, k // 32, 32)
    d = (_signed_max(b) / np.float32(-127)).astype(np.float16)
    inv = np.where(d == 0, 0, 1 / d.astype(np.float32))
    out = np.concatenate([d[..., None].view(np.uint8), _nibbles(b * inv[..., None])], axis=-1)
    return out.reshape(*lead, k // 32 * 18)


def _iq4_xs(w: np.ndarray) -> np.ndarray:
    lead, k = w.shape[:-1], w.shape[-1]
    b = w.reshape(-1, k // 256, 8, 32)
    sub = _signed_max(b) / np.float32(-127)  # each 32's wanted scale
    d = (np.abs(sub).max(axis=-1) / 31).astype(np.float16)  # ls - 32 in [-32, 31]
    inv = np.where(d == 0, 0, 1 / d.astype(np.float32))
    ls = np.clip(np.rint(sub * inv[..., None]) + 32, 0, 63).astype(np.uint8)
    dl = d.astype(np.float32)[..., None] * (ls.astype(np.float32) - 32)
    nib = _nibbles(b * np.where(dl == 0, 0, 1 / np.where(dl == 0, 1, dl))[..., None])  # [.., 8, 16]
    high = np.zeros(ls.shape[:-1], dtype=np.uint16)
    for i in range(8):
        high |= (ls[..., i].astype(np.uint16) >> 4) << (2 * i)
    low = (ls[..., 0::2] & 15) | ((ls[..., 1::2] & 15) << 4)  # [.., 4]
    parts = [
        d[..., None].view(np.uint8),
        high[..., None].view(np.uint8),
        low,
        nib.reshape(*nib.shape[:-2], 128),
    ]
    return np.concatenate(parts, axis=-1).reshape(*lead, k // 256 * 136)
