"""A mixture of experts' experts computed on a GGUF's stacked blocks (models/moe.py's ``Experts``).

The model hands over the step's rows grouped by expert (``ExpertGroups``: the (token, expert) pairs
sorted by expert). Each expert that has rows runs its gate and up projections over all of them,
silu(gate) * up, then its down projection: its weights are read once per step, whatever the number
of rows that chose it, by the same kernels, and the same row-count plan (integer or dense path), as
any Linear on blocks. With SiLU (Qwen3-MoE's, Mixtral's) the whole block is one C call
(csrc/moe.c: the rows gathered, every expert with rows, the weighted sum back per token); otherwise,
and as the reference its test compares with, ``per_expert`` runs each expert's two ``QuantLinear``
calls from Python.

Blocks are re-laid by 8 rows (layouts.py) where each expert's rows are a multiple of 8, so no group
of 8 rows spans two experts and each expert's rows stay a slice of the stacked tensor.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpu_worker.backends.cpu.build import DTYPE_CODES
from gpu_worker.backends.cpu.hugepages import HugePageArena
from gpu_worker.backends.cpu.kernels import CpuKernels
from gpu_worker.backends.cpu.layouts import interleave_rows, interleaves, kernel_type
from gpu_worker.backends.cpu.quant import QuantLinear
from gpu_worker.models.moe import ExpertGroups
from gpu_worker.weights.formats import QuantBlocks, QuantizedExperts, QuantizedWeight


class MoeProjection(ctypes.Structure):
    """csrc/rivulet_kernels.h's ``moe_projection``: one projection of every expert, stacked."""

    _fields_ = [
        ("w", ctypes.c_void_p),
        ("type", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("row_bytes", ctypes.c_int64),
        ("dense_min_rows", ctypes.c_int64),
        ("a8_min_rows", ctypes.c_int64),
    ]


def _relays(weight: QuantizedExperts, part: QuantBlocks) -> bool:
    """Whether ``interleave_experts`` re-lays this projection: its experts' rows are whole groups."""
    return (part.rows // weight.num_experts) % 8 == 0 and interleaves(part)


def relaid_experts(weight: QuantizedExperts) -> list[QuantBlocks]:
    """The projections ``interleave_experts`` re-lays."""
    return [part for part in weight.projections if _relays(weight, part)]


def interleave_experts(weight: QuantizedExperts, arena: HugePageArena | None = None) -> QuantizedExperts:
    """Each projection's rows interleaved by 8 (layouts.py) where an expert's rows are whole groups,
    written into ``arena`` if given."""

    def relaid(part: QuantBlocks) -> QuantBlocks:
        if not _relays(weight, part):
            return part
        return interleave_rows(part, None if arena is None else arena.take(tuple(part.data.shape)))

    gate, up, down = (relaid(part) for part in weight.projections)
    return QuantizedExperts(gate, up, down, weight.num_experts)


class QuantRouter:
    """The router of a block whose experts are on blocks, in one C call (csrc/moe.c's moe_route):
    its logits, softmax, top-k and renormalisation, as the one-call decode routes (decode_layers.c),
    so that both pick the same experts with the same weights, bit for bit."""

    def __init__(self, weight: torch.Tensor, top_k: int, norm_topk: bool, kernels: CpuKernels) -> None:
        self.weight = weight.detach().contiguous()  # [E, hidden], the activations' dtype
        self.top_k, self.norm_topk, self.kernels = top_k, norm_topk, kernels

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.moe_route(x, self.weight, self.top_k, self.norm_topk)


class QuantExperts:
    """The experts over grouped rows, on blocks: one gate/up call and one down call per expert with rows."""

    def __init__(
        self,
        weight: QuantizedExperts,
        kernels: CpuKernels,
        act: Callable[[torch.Tensor], torch.Tensor],
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
        self.kernels = kernels
        self.one_call = act is F.silu
        # Gate and up share their quantized rows: 8-bit activations from the later of their two
        # thresholds, for both (quant.py's A8_MIN_ROWS gives the K-quants one threshold a kind).
        gate_up_a8 = max(self.gate_up[0].a8_min_rows)
        for linear in self.gate_up:
            linear.a8_min_rows = [gate_up_a8, gate_up_a8]
        # Per projection: expert 0's QuantLinear part holds the row-count plan of every expert's.
        plans = (
            (self.gate_up[0].dense_min_rows[0], gate_up_a8),
            (self.gate_up[0].dense_min_rows[1], gate_up_a8),
            (self.down[0].dense_min_rows[0], self.down[0].a8_min_rows[0]),
        )
        self.projections = (MoeProjection * 3)(
            *(
                MoeProjection(
                    p.data.data_ptr(), kernel_type(p), p.rows // weight.num_experts, p.data.shape[1], *plan
                )
                for p, plan in zip(weight.projections, plans, strict=True)
            )
        )
        self.hidden, self.inner = (
            weight.down.rows // weight.num_experts,
            weight.gate.rows // weight.num_experts,
        )

    def tensors(self) -> list[torch.Tensor]:
        """What the experts hold (for the worker's count of weight bytes)."""
        return [part.data for part in self.weight.projections]

    def group(self, expert_ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> ExpertGroups:
        """``ExpertGroups.of`` in one C call (csrc/moe.c's moe_group): the same pairs, in the same order."""
        if weights.dtype not in DTYPE_CODES:
            return ExpertGroups.of(expert_ids, weights, num_experts)
        tokens, sorted_weights, spans = self.kernels.moe_group(
            expert_ids.contiguous(), weights.contiguous(), num_experts
        )
        return ExpertGroups(tokens, sorted_weights.unsqueeze(1), spans, expert_ids.shape[0])

    def __call__(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        if not self.one_call:
            return self.per_expert(x, groups)
        x = x.contiguous()
        weights = groups.weights.reshape(-1).contiguous()
        return self.kernels.moe_experts(
            self.projections, self.hidden, self.inner, x, groups.tokens, weights, groups.spans
        )

    def per_expert(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """The same, each expert's two matmuls called from Python (the C call's reference)."""
        rows = x.index_select(0, groups.tokens)
        out = torch.empty_like(rows)
        for expert, start, count in groups.spans.tolist():
            gate_up = self.gate_up[expert](rows[start : start + count])
            out[start : start + count] = self.down[expert](self.act_mul(gate_up))
        return groups.combine(out)
