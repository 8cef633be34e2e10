"""A Gemma 4 decode step's inputs (``Gemma4ForCausalLM.embedded``: the token and per-layer tables'
rows, the per-layer projection, its norm and scales) in one C call, csrc/decode_gemma4.c's
decode_gemma4_inputs, where both tables and the projection are in blocks; else, and on a step of a
model with media placeholders, ``embedded`` itself. The call saves ``embedded``'s torch ops, each
costly on caches the weights' stream has just emptied (what they cost: docs/benchmarks-history.md,
"Gemma 4's one-row step outside the C calls"); its rows equal ``embedded``'s bit for bit
(tests/gpu_worker/test_decode_gemma4.py)."""

from __future__ import annotations

from typing import Any

import torch

from gpu_worker.backends.cpu.decode_gemma4_kernels import Gemma4Dims, Gemma4Inputs, Gemma4Kernels
from gpu_worker.backends.cpu.decode_structs import DecodeLinear, quant_linears
from gpu_worker.backends.cpu.layouts import kernel_type
from gpu_worker.backends.cpu.quant import QuantEmbedding
from gpu_worker.forward_context import ForwardContext
from gpu_worker.models.gemma4 import Gemma4ForCausalLM
from gpu_worker.models.gemma4_blocks import Gemma4RMSNorm


def c_inputs(model: Gemma4ForCausalLM) -> Gemma4Inputs | None:
    """``embedded``'s operands for decode_gemma4_inputs, or None (``embedded`` runs) where a table is
    not a QuantEmbedding, the projection not a QuantLinear without a bias, the norm not the kernels',
    a scale not float32, or the per-layer table holds fewer rows than the token table (the runner
    checks ids against the vocabulary)."""
    body: Any = model.model
    if not body.per_layer_dim:
        return None
    embed, table = body.embed_tokens.impl, body.embed_tokens_per_layer.impl
    norm: Gemma4RMSNorm = body.per_layer_projection_norm
    projection = quant_linears([body.per_layer_model_projection])
    if not (isinstance(embed, QuantEmbedding) and isinstance(table, QuantEmbedding)) or projection is None:
        return None
    scales = (body.embed_scale, body.per_layer_scale)
    if norm.scale32 is None or norm.fused is None or any(s.dtype != torch.float32 for s in scales):
        return None
    if table.table.data.shape[0] < embed.table.data.shape[0]:
        return None
    return Gemma4Inputs(
        embed=embed.table.data.data_ptr(), per_layer_table=table.table.data.data_ptr(),
        per_layer_norm=norm.scale32.data_ptr(), projection=DecodeLinear.of(projection[0]),
        embed_type=kernel_type(embed.table), per_layer_type=kernel_type(table.table),
        embed_scale=float(body.embed_scale), per_layer_scale=float(body.per_layer_scale),
        projection_scale=embed.table.cols**-0.5, mean_scale=2.0**-0.5, eps=norm.eps,
    )  # fmt: skip


class StepInputs:
    """A decode step's x [T, hidden] and per-layer inputs [T, layers, dim] (or None), by the C call
    where ``c_inputs`` gives its operands (``operands``), else by ``embedded``."""

    def __init__(self, model: Gemma4ForCausalLM, c_kernels: Gemma4Kernels, dims: Gemma4Dims) -> None:
        self.model: Any = model
        self.c_kernels = c_kernels
        self.dims = dims
        self.operands = c_inputs(model)

    def __call__(
        self, input_ids: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.operands is not None and not len(self.model.media_token_ids):
            return self.c_kernels.inputs(self.operands, self.dims, input_ids)
        return self.model.embedded(input_ids, ctx)
