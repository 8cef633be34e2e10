"""gpt-oss's experts (models/gpt_oss.py's ``ClampedSwigluExperts``) computed on a GGUF's stacked blocks
(MXFP4 in gpt-oss's files) in one C call a layer, as experts.py computes the SiLU ones: csrc/moe.c's
moe_experts_clamped adds each expert's biases to its projections and applies the clamped SwiGLU, each
expert's weights read once per step whatever the number of its rows. ``per_expert`` runs each
expert's two ``QuantLinear`` calls from Python instead, the C call's reference in its test.
"""

from __future__ import annotations

import torch

from gpu_worker.backends.cpu.experts import QuantExperts
from gpu_worker.backends.cpu.kernels import CpuKernels
from gpu_worker.backends.cpu.quant_kernels import ClampedAct
from gpu_worker.models.gpt_oss import ClampedSwigluExperts
from gpu_worker.models.moe import ExpertGroups, Experts


class ClampedQuantExperts:
    """The experts over grouped rows, on blocks, biases added and the clamped SwiGLU applied. Not a
    ``QuantExperts`` (it holds one): a sparse block with those gets moe_route's router, which
    knows neither gpt-oss's router bias nor its top-k softmax."""

    def __init__(self, module: ClampedSwigluExperts, kernels: CpuKernels, dtype: torch.dtype) -> None:
        weight = module.quantized
        assert weight is not None, "experts on blocks only"
        self.blocks = QuantExperts(weight, kernels, module.act, module.act_mul)  # its structs and plans
        self.glu = module.glu
        gate_up_bias, down_bias = (b.to(dtype).contiguous() for b in module.split_biases())
        self.clamped = ClampedAct(gate_up_bias, down_bias, module.alpha, module.limit)
        for e in range(weight.num_experts):
            self.blocks.gate_up[e].bias, self.blocks.down[e].bias = gate_up_bias[e], down_bias[e]

    def tensors(self) -> list[torch.Tensor]:
        """What the experts hold (for the worker's count of weight bytes)."""
        return [*self.blocks.tensors(), self.clamped.gate_up_bias, self.clamped.down_bias]

    def group(self, expert_ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> ExpertGroups:
        return self.blocks.group(expert_ids, weights, num_experts)

    def __call__(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        b, x = self.blocks, x.contiguous()
        weights = groups.weights.reshape(-1).contiguous()
        return b.kernels.moe_experts(
            b.projections, b.hidden, b.inner, x, groups.tokens, weights, groups.spans, self.clamped
        )

    def per_expert(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """The same, each expert's two matmuls (with their biases) called from Python."""
        rows = x.index_select(0, groups.tokens)
        out = torch.empty_like(rows)
        inner = self.blocks.inner
        for expert, start, count in groups.spans.tolist():
            gate_up = self.blocks.gate_up[expert](rows[start : start + count])
            glu = self.glu(gate_up[:, :inner], gate_up[:, inner:])
            out[start : start + count] = self.blocks.down[expert](glu)
        return groups.combine(out)


def experts_impl(
    module: Experts, kernels: CpuKernels, dtype: torch.dtype
) -> QuantExperts | ClampedQuantExperts:
    """The computation on blocks of a stacked-experts layer, by its type: gpt-oss's clamped experts
    here, moe.py's SiLU ones by experts.py."""
    if isinstance(module, ClampedSwigluExperts):
        return ClampedQuantExperts(module, kernels, dtype)
    assert module.quantized is not None, "experts on blocks only"
    return QuantExperts(module.quantized, kernels, module.act, module.act_mul)
