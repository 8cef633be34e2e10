"""A mixture of experts' experts computed on a GGUF's stacked blocks (models/moe.py's ``Experts``).

The model hands over the step's rows grouped by expert (``ExpertGroups``: the (token, expert) pairs
sorted by expert). Each expert that has rows runs its gate and up projections over all of them in
one ``QuantLinear`` (two parts, each writing its columns of [rows, 2 * inner]), silu(gate) * up, then
its down projection: its weights are read once per step, whatever the number of rows that chose it,
by the same kernels, and the same row-count plan (integer or dense path), as any Linear on blocks.

Blocks are re-laid by 8 rows (layouts.py) where each expert's rows are a multiple of 8, so no group
of 8 rows spans two experts and each expert's rows stay a slice of the stacked tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpu_worker.backends.cpu.kernels import CpuKernels
from gpu_worker.backends.cpu.layouts import interleave_rows
from gpu_worker.backends.cpu.quant import QuantLinear
from gpu_worker.models.moe import ExpertGroups
from gpu_worker.weights.formats import QuantBlocks, QuantizedExperts, QuantizedWeight


def interleave_experts(weight: QuantizedExperts) -> QuantizedExperts:
    """Each projection's rows interleaved by 8 (layouts.py) where an expert's rows are whole groups."""

    def relaid(part: QuantBlocks) -> QuantBlocks:
        per_expert = part.rows // weight.num_experts
        return interleave_rows(part) if per_expert % 8 == 0 else part

    gate, up, down = (relaid(part) for part in weight.projections)
    return QuantizedExperts(gate, up, down, weight.num_experts)


class QuantExperts:
    """The experts over grouped rows, on blocks: one gate/up call and one down call per expert with rows."""

    def __init__(
        self,
        weight: QuantizedExperts,
        kernels: CpuKernels,
        act_mul: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.weight = weight
        self.act_mul = act_mul  # the module's: silu(gate) * up, by the fused kernel where set
        self.gate_up: list[QuantLinear] = []
        self.down: list[QuantLinear] = []
        for e in range(weight.num_experts):
            gate, up, down = weight.expert(e)
            self.gate_up.append(QuantLinear(QuantizedWeight((gate, up)), None, kernels))
            self.down.append(QuantLinear(QuantizedWeight((down,)), None, kernels))

    def tensors(self) -> list[torch.Tensor]:
        """What the experts hold (for the worker's count of weight bytes)."""
        return [part.data for part in self.weight.projections]

    def __call__(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        rows = x.index_select(0, groups.tokens)
        out = torch.empty_like(rows)
        for expert, start, count in groups.spans:
            gate_up = self.gate_up[expert](rows[start : start + count])
            out[start : start + count] = self.down[expert](self.act_mul(gate_up))
        return groups.combine(out)
