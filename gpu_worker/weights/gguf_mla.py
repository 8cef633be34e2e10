"""A latent-attention GGUF's (``deepseek2``) split kv_b joined back into HF's ``kv_b_proj``, and its
multi-token-prediction layers dropped.

Newer llama.cpp converters store each layer's kv_b [H (nope + v), r] as two tensors for their
absorbed decode: ``attn_k_b``, each head's key rows transposed ([H, r, nope]), and ``attn_v_b``, each
head's value rows ([H, v, r]); older files keep ``attn_kv_b`` whole. The layer holds kv_b as HF does
(models/mla.py's ``LatentProjection``, a tensor), so the pair is dequantized and interleaved back per
head: [H, nope + v, r], the key rows first. Where the loader keeps the pair's types in blocks, the
pair's blocks are kept too (``kept``; the layer's ``quantized``), for a backend whose absorbed decode
reads them (backends/cpu/latent_heads.py): a decode step then reads 1.3 MB a layer, not 8.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch
from torch import nn

from gpu_worker.models.mla import LatentProjection
from gpu_worker.weights.formats import QuantBlocks, dequantize_blocks

Tensor = tuple[str, int, np.ndarray, tuple[int, ...]]  # (HF name, ggml type, data, HF shape)
F32 = 0
_SPLIT = (".self_attn.k_b_proj.weight", ".self_attn.v_b_proj.weight")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def joined_kv_b(
    tensors: Iterable[Tensor], num_layers: int, kept: dict[str, tuple[QuantBlocks, QuantBlocks]] | None = None
) -> Iterator[Tensor]:
    """``tensors`` with each layer's k_b / v_b pair replaced by its kv_b_proj (float32), yielded once
    both are read; the layers past ``num_layers`` (a file's multi-token-prediction layers, not served)
    dropped; every other tensor as it comes. ``kept`` (given where the loader keeps blocks) gets the
    kv_b_proj's name -> the pair's blocks (``hold_heads`` gives them to the layers)."""
    halves: dict[str, dict[str, Tensor]] = {}
    for tensor in tensors:
        name = tensor[0]
        layer_number = _LAYER.match(name)
        if layer_number is not None and int(layer_number.group(1)) >= num_layers:
            continue
        if not name.endswith(_SPLIT):
            yield tensor
            continue
        layer, _, part = name.rpartition(".self_attn.")
        pair = halves.setdefault(layer, {})
        pair[part] = tensor
        if len(pair) == 2:
            del halves[layer]
            k_b, v_b = pair["k_b_proj.weight"], pair["v_b_proj.weight"]
            if kept is not None:
                kept[f"{layer}.self_attn.kv_b_proj"] = (_blocks(k_b), _blocks(v_b))
            yield (
                f"{layer}.self_attn.kv_b_proj.weight",
                F32,
                *_join(pair["k_b_proj.weight"], pair["v_b_proj.weight"]),
            )
    assert not halves, f"a k_b without its v_b (or the reverse): {sorted(halves)}"


def _join(k_b: Tensor, v_b: Tensor) -> tuple[np.ndarray, tuple[int, ...]]:
    keys = dequantize_blocks(k_b[1], k_b[2], k_b[3]).transpose(1, 2)  # [H, nope, r]
    values = dequantize_blocks(v_b[1], v_b[2], v_b[3])  # [H, v, r]
    joined = np.concatenate((keys.numpy(), values.numpy()), axis=1)
    heads, rows, rank = joined.shape
    return np.ascontiguousarray(joined.reshape(heads * rows, rank)), (heads * rows, rank)


def _blocks(tensor: Tensor) -> QuantBlocks:
    return QuantBlocks(tensor[1], torch.from_numpy(tensor[2].view(np.uint8)), tensor[3][-1])


def hold_heads(
    model: nn.Module, kept: dict[str, tuple[QuantBlocks, QuantBlocks]], holds: Callable[[QuantBlocks], bool]
) -> None:
    """Each kv_b_proj in ``kept`` whose pair ``holds`` both halves of given the pair (its ``quantized``)."""
    for name, pair in kept.items():
        projection = model.get_submodule(name)
        assert isinstance(projection, LatentProjection), name
        if all(holds(half) for half in pair):
            projection.quantized = pair
