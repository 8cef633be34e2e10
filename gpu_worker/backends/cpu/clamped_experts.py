"""gpt-oss's experts (models/gpt_oss.py's ``ClampedSwigluExperts``) computed on a GGUF's stacked blocks
(MXFP4 in gpt-oss's files) in one C call a layer, as experts.py computes the SiLU ones: csrc/moe.c's
moe_experts_clamped adds each expert's biases to its projections and applies the clamped SwiGLU, each
expert's weights read once per step whatever the number of its rows. ``per_expert`` runs each
expert's two ``QuantLinear`` calls from Python instead, the C call's reference in its test.
``TopKRouter`` routes the rows in one C call (moe_route_topk: the router's bias, the softmax of the
top-k logits), the call the one-call decode routes by too (csrc/decode_layers.c).
"""

from __future__ import annotations

import torch

from gpu_worker.backends.cpu.experts import QuantExperts, QuantRouter
from gpu_worker.backends.cpu.kernels import CpuKernels
from gpu_worker.backends.cpu.quant_kernels import ClampedAct
from gpu_worker.models.gpt_oss import ClampedSwigluExperts, TopKSoftmaxMoeBlock
from gpu_worker.models.moe import ExpertGroups, Experts, SparseMoeBlock


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


class TopKRouter:
    """gpt-oss's router in one C call (csrc/moe.c's moe_route_topk): the logits plus the bias, each
    row's top-k of them and their softmax, as ``TopKSoftmaxMoeBlock.route``'s torch code computes
    them (in float32), and as the one-call decode routes."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, top_k: int, kernels: CpuKernels) -> None:
        self.weight = weight.detach().contiguous()  # [E, hidden], the activations' dtype
        self.bias = bias.detach().contiguous()  # [E], alike
        self.top_k, self.kernels = top_k, kernels

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.moe_route(x, self.weight, self.top_k, True, self.bias)


def router_impl(
    module: SparseMoeBlock, kernels: CpuKernels, dtype: torch.dtype
) -> QuantRouter | TopKRouter | None:
    """The C router of a sparse block whose experts are on blocks, by the block's type (None: its
    torch code routes): gpt-oss's here, moe.py's softmax-then-top-k one in experts.py."""
    gate, impl = module.gate, module.experts.impl
    if gate.quantized is not None:  # a router on blocks: its Linear's kernel computes the logits
        return None
    weight = gate.weight.to(dtype)
    if isinstance(module, TopKSoftmaxMoeBlock) and isinstance(impl, ClampedQuantExperts):
        assert gate.bias is not None, "gpt-oss's router has a bias"
        return TopKRouter(weight, gate.bias.to(dtype), module.top_k, kernels)
    if isinstance(impl, QuantExperts):
        return QuantRouter(weight, module.top_k, module.norm_topk_prob, kernels)
    return None
