"""An HF checkpoint's MXFP4 weights (gpt-oss's experts: ``*_blocks`` and ``*_scales``) as ggml's MXFP4
blocks, which the CPU kernels compute on (csrc/quant_sub32.c).

Both hold 32 E2M1 values per block with one E8M0 exponent. HF's ``blocks`` [..., rows, k / 32, 16]
pack values 2i (low nibble) and 2i + 1 (high nibble) in byte i of a block, ``scales`` [..., rows,
k / 32] the exponent with bias 127 over the plain E2M1 values; a ggml block is its exponent byte then
16 bytes, byte j holding value j (low nibble) and value j + 16 (high), over doubled values with bias
128: the same exponent byte.

A checkpoint's MXFP4 tensors load dequantized (``unpack_mxfp4``, loader.py) into the parameter their
name without ``_blocks`` / ``_scales`` stands for, or, where the backend computes on MXFP4 (the CPU
kernels), gpt-oss's experts keep them as blocks (``hold_mxfp4_experts``), as a GGUF's are.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from gpu_worker.weights.formats import QuantBlocks, QuantizedExperts

if TYPE_CHECKING:
    from torch import nn

    from gpu_worker.models.moe import Experts


def ggml_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, k / 32 * 17]: ggml's MXFP4 blocks of HF's ``blocks`` / ``scales`` (leading dims
    flattened into rows)."""
    assert blocks.dtype == torch.uint8 and scales.dtype == torch.uint8
    assert blocks.shape[:-1] == scales.shape and blocks.shape[-1] == 16, "blocks [..., k / 32, 16]"
    nibbles = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # value order, 32 a block
    packed = nibbles[..., :16] | (nibbles[..., 16:] << 4)
    rows = blocks.shape[:-2].numel()
    return torch.cat((scales.unsqueeze(-1), packed), dim=-1).reshape(rows, -1).contiguous()


PACKED = re.compile(r"^(.*)_(blocks|scales)$")  # an HF checkpoint's MXFP4 tensor: its blocks or scales


def unpack_mxfp4(packed: dict[str, dict[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(the tensor's name, its float32 values [..., rows, k]) of each name's ``blocks`` and ``scales``
    (``packed[name]``), dequantized as gguf-py dequantizes ggml's MXFP4 (exact: every value is a
    small integer times a power of 2)."""
    import gguf

    for name, parts in packed.items():
        if set(parts) != {"blocks", "scales"}:
            raise ValueError(f"{name}: an MXFP4 tensor needs both _blocks and _scales, not {sorted(parts)}")
        blocks = parts["blocks"]
        values = gguf.quants.dequantize(
            ggml_mxfp4(blocks, parts["scales"]).numpy(), gguf.GGMLQuantizationType.MXFP4
        )
        yield name, torch.from_numpy(values).reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)


MXFP4 = 39  # ggml's type id


def kept_experts(model: nn.Module, checkpoint_keys: set[str], keep: frozenset[int]) -> dict[str, Experts]:
    """The stacked experts whose checkpoint holds both projections in MXFP4 and whose blocks stay
    blocks (MXFP4 in ``keep``, the model's experts of a kind that computes on them): module name ->
    module. Their float parameters are never allocated."""
    from gpu_worker.models.gpt_oss import ClampedSwigluExperts

    if MXFP4 not in keep:
        return {}
    wanted = [f"{proj}_{part}" for proj in ("gate_up_proj", "down_proj") for part in ("blocks", "scales")]
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, ClampedSwigluExperts) and all(f"{name}.{w}" in checkpoint_keys for w in wanted)
    }


def hold_mxfp4_experts(module: Experts, packed: dict[str, dict[str, torch.Tensor]]) -> None:
    """Give gpt-oss's experts their checkpoint's MXFP4 blocks as they are (gate and up rows, interleaved
    in HF's ``gate_up_proj``, split apart: whole rows move, every block stays whole)."""
    experts = module.num_experts
    gate_up = ggml_mxfp4(packed["gate_up_proj"]["blocks"], packed["gate_up_proj"]["scales"])
    down = ggml_mxfp4(packed["down_proj"]["blocks"], packed["down_proj"]["scales"])
    hidden, inner = (
        packed["gate_up_proj"]["blocks"].shape[-2] * 32,
        packed["down_proj"]["blocks"].shape[-2] * 32,
    )
    rows = gate_up.view(experts, 2 * inner, -1)
    gate, up = (rows[:, first::2].reshape(experts * inner, -1).contiguous() for first in (0, 1))
    module.hold_blocks(
        QuantizedExperts(
            QuantBlocks(MXFP4, gate, hidden),
            QuantBlocks(MXFP4, up, hidden),
            QuantBlocks(MXFP4, down, inner),
            experts,
        )
    )
