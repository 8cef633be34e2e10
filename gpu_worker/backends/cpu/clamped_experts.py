"""gpt-oss's experts (models/gpt_oss.py's ``ClampedSwigluExperts``) computed on a GGUF's stacked blocks
(MXFP4 in gpt-oss's files): per expert with rows, its gate and up projections as one ``QuantLinear``
with their biases, the clamped SwiGLU in torch, then its down projection with its bias. csrc/moe.c's
one call computes SiLU experts without biases, so these run from Python, each expert's weights read
once per step whatever the number of its rows.
"""

from __future__ import annotations

import torch

from gpu_worker.backends.cpu.experts import QuantExperts
from gpu_worker.backends.cpu.kernels import CpuKernels
from gpu_worker.backends.cpu.quant import QuantLinear
from gpu_worker.models.gpt_oss import ClampedSwigluExperts
from gpu_worker.models.moe import ExpertGroups, Experts
from gpu_worker.weights.formats import QuantizedWeight


class ClampedQuantExperts:
    """The experts over grouped rows, on blocks, biases added and the clamped SwiGLU applied."""

    def __init__(self, module: ClampedSwigluExperts, kernels: CpuKernels, dtype: torch.dtype) -> None:
        weight = module.quantized
        assert weight is not None, "experts on blocks only"
        self.weight, self.glu, self.inner = weight, module.glu, weight.gate.rows // weight.num_experts
        gate_up_bias, down_bias = (b.to(dtype) for b in module.split_biases())
        self.biases = [gate_up_bias, down_bias]
        self.gate_up: list[QuantLinear] = []
        self.down: list[QuantLinear] = []
        for e in range(weight.num_experts):
            gate, up, down = weight.expert(e)
            self.gate_up.append(QuantLinear(QuantizedWeight((gate, up)), gate_up_bias[e], kernels))
            self.down.append(QuantLinear(QuantizedWeight((down,)), down_bias[e], kernels))

    def tensors(self) -> list[torch.Tensor]:
        """What the experts hold (for the worker's count of weight bytes)."""
        return [part.data for part in self.weight.projections] + self.biases

    def __call__(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        rows = x.index_select(0, groups.tokens)
        out = torch.empty_like(rows)
        for expert, start, count in groups.spans.tolist():
            gate_up = self.gate_up[expert](rows[start : start + count])
            glu = self.glu(gate_up[:, : self.inner], gate_up[:, self.inner :])
            out[start : start + count] = self.down[expert](glu)
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
