"""Mixture-of-experts decoders: Qwen3-MoE and Mixtral, Llama's decoder (llama.py) with a sparse
feed-forward block on some or all layers.

A sparse block is a router and E SwiGLU experts. The router is a Linear to E logits, softmaxed in
float32 (as HF does in every dtype); each token keeps its top k experts, their probabilities
renormalised to sum to 1 (Mixtral always, Qwen3-MoE with ``norm_topk_prob``). A token's output is
the probability-weighted sum of its k experts' outputs. Qwen3-MoE's other layers (``mlp_only_layers``,
``decoder_sparse_step``) keep Llama's dense MLP; its attention RMS-norms q and k per head (as Qwen3's).

The experts' weights are stacked as HF holds them in memory: ``gate_up_proj`` [E, 2 * inner, hidden]
(each expert's gate rows first), ``down_proj`` [E, hidden, inner]; the loader fills expert e's
blocks from the checkpoint's ``experts.{e}.gate_proj`` etc. A GGUF's stacked blocks are kept as
``QuantizedExperts`` instead, which only a backend's ``impl`` computes on.

Rows are grouped by expert (``ExpertGroups``): the step's (token, expert) pairs sorted by expert,
so each expert that has rows runs once over all of its rows, its weights read once per step however
many rows chose it.

Under tensor parallel an ``Experts`` holds a contiguous range of the experts (``first_expert``,
``num_experts``: tensor_parallel.py sets them) and computes the pairs routed to those alone; the
router is whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.models.contract import Layer, Split
from gpu_worker.models.layers import FusedOps, Linear, activation
from gpu_worker.models.llama import MLP, FeedForward, LlamaForCausalLM

if TYPE_CHECKING:
    from gpu_worker.weights.formats import QuantizedExperts


@dataclass(frozen=True)
class MoeArgs:
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    inner: int  # each expert's intermediate size
    sparse_layers: tuple[bool, ...]  # per layer: a sparse block (else the dense MLP)

    @classmethod
    def from_hf(cls, cfg: Any) -> MoeArgs:
        experts = int(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
        dense = set(getattr(cfg, "mlp_only_layers", None) or ())
        step = int(getattr(cfg, "decoder_sparse_step", None) or 1)
        return cls(
            num_experts=experts,
            top_k=int(cfg.num_experts_per_tok),
            norm_topk_prob=bool(getattr(cfg, "norm_topk_prob", True)),  # Mixtral's has none: always
            inner=int(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size),
            sparse_layers=tuple(
                i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(cfg.num_hidden_layers)
            ),
        )


@dataclass(frozen=True)
class ExpertGroups:
    """A step's (token, expert) pairs sorted by expert (stably: tokens ascending within an expert).

    Pair i of the sorted order is token ``tokens[i]`` routed with probability ``weights[i]``;
    ``spans`` lists (expert, start, count) for each expert that has pairs, experts ascending, its
    pairs being [start, start + count)."""

    tokens: torch.Tensor  # int64 [T * k]
    weights: torch.Tensor  # [T * k, 1], the activations' dtype
    spans: torch.Tensor  # int64 [experts with pairs, 3]: (expert, start, count) rows
    num_tokens: int

    @classmethod
    def of(cls, expert_ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> ExpertGroups:
        """From each token's top-k ``expert_ids`` and their ``weights`` ([T, k] both)."""
        flat = expert_ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts)
        used = counts.nonzero().flatten()
        starts = counts.cumsum(0) - counts
        top_k = expert_ids.shape[1]
        return cls(
            tokens=order // top_k,
            weights=weights.flatten().index_select(0, order).unsqueeze(1),
            spans=torch.stack((used, starts[used], counts[used]), dim=1),
            num_tokens=expert_ids.shape[0],
        )

    def held(self, first: int, count: int) -> ExpertGroups:
        """The pairs of experts [first, first + count) alone, those experts numbered from 0: one
        slice of the sorted pairs (a contiguous range of experts holds a contiguous range of pairs)."""
        experts = self.spans[:, 0]
        mine = (experts >= first) & (experts < first + count)
        spans = self.spans[mine]
        start = int(spans[0, 1]) if len(spans) else 0
        stop = int(spans[-1, 1] + spans[-1, 2]) if len(spans) else 0
        shift = torch.tensor([first, start, 0], dtype=spans.dtype)
        return ExpertGroups(
            tokens=self.tokens[start:stop],
            weights=self.weights[start:stop],
            spans=spans - shift,
            num_tokens=self.num_tokens,
        )

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        """[T, hidden]: each token's weighted expert outputs (``expert_out`` [T * k, hidden], sorted
        as the pairs are) summed in ascending expert order, as HF's eager experts add them."""
        out = expert_out.new_zeros((self.num_tokens, expert_out.shape[1]))
        return out.index_add_(0, self.tokens, expert_out * self.weights)


class ExpertsImpl(Protocol):
    """A device backend's computation of the experts over grouped rows (its weight layouts, kernels),
    and its grouping of the rows (``ExpertGroups.of``'s pairs, in the same order)."""

    def __call__(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor: ...

    def group(self, expert_ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> ExpertGroups: ...


class Experts(Layer):
    """E SwiGLU experts, weights stacked. ``impl`` (set by a backend) computes them instead of the
    torch code below; ``quantized`` (set by the GGUF loader instead of the parameters) only an
    ``impl`` reads. It holds the experts [first_expert, first_expert + num_experts) of the router's
    ``routed_experts`` (all of them but under tensor parallel)."""

    split = Split.EXPERTS
    kernel_slots = ("impl", "fused")
    impl: ExpertsImpl | None = None
    first_expert = 0
    quantized: QuantizedExperts | None = None
    fused: FusedOps | None = None  # a device backend's: silu(gate) * up in one call

    def __init__(self, num_experts: int, hidden: int, inner: int, act: str) -> None:
        super().__init__()
        self.num_experts, self.routed_experts, self.inner = num_experts, num_experts, inner
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inner, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inner), requires_grad=False)
        self.act = activation(act)

    def options(self) -> dict[str, Any]:
        return {"act": self.act}

    def hold_blocks(self, weight: QuantizedExperts) -> None:
        """Loading: the experts' weights are ``weight``'s stacked blocks; the parameters, never
        written, are emptied (which frees their address space)."""
        dtype = self.gate_up_proj.dtype
        self.quantized = weight
        self.gate_up_proj = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)

    def checkpoint_views(self) -> dict[str, torch.Tensor]:
        """The checkpoint's per-expert names (relative to this module) -> the blocks they fill."""
        views: dict[str, torch.Tensor] = {}
        inner = self.inner
        for e in range(self.num_experts):
            views[f"{e}.gate_proj.weight"] = self.gate_up_proj[e, :inner]
            views[f"{e}.up_proj.weight"] = self.gate_up_proj[e, inner:]
            views[f"{e}.down_proj.weight"] = self.down_proj[e]
        return views

    def gguf_views(self) -> dict[str, torch.Tensor]:
        """The names a GGUF's tensors (its stacked ``ffn_*_exps``, per expert) fill: here the
        checkpoint's; a family whose checkpoint stacks its experts otherwise gives its own."""
        return self.checkpoint_views()

    def group(self, expert_ids: torch.Tensor, weights: torch.Tensor) -> ExpertGroups:
        """Each row's top-k ``expert_ids`` and their ``weights`` ([T, k], the activations' dtype)
        grouped by expert, over every routed expert: by ``impl`` where set (one call rather than
        ExpertGroups.of's dozen torch ops a layer)."""
        if self.impl is not None:
            return self.impl.group(expert_ids, weights, self.routed_experts)
        return ExpertGroups.of(expert_ids, weights, self.routed_experts)

    def forward(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """[T, hidden]: each token's experts' outputs, weighted and summed (over the experts held)."""
        if self.num_experts < self.routed_experts:
            groups = groups.held(self.first_expert, self.num_experts)
        if self.impl is not None:
            return self.impl(x, groups)
        return self.compute(x, groups)

    def compute(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """``forward``'s torch code, over groups of the experts held (numbered from 0)."""
        assert self.quantized is None, "stacked blocks are computed by a backend's impl alone"
        rows = x.index_select(0, groups.tokens)
        out = torch.empty_like(rows)
        for expert, start, count in groups.spans.tolist():
            gate_up = F.linear(rows[start : start + count], self.gate_up_proj[expert])
            out[start : start + count] = F.linear(self.act_mul(gate_up), self.down_proj[expert])
        return groups.combine(out)

    def act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up of [rows, 2 * inner]."""
        if self.fused is not None and self.act is F.silu and gate_up.is_contiguous():
            return self.fused.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up


class RouterImpl(Protocol):
    """A device backend's router in one call: each row's top-k expert ids [T, k] and their weights
    [T, k] (renormalised as the block's ``norm_topk_prob`` says), as ``SparseMoeBlock.route``'s torch
    code computes them."""

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class SparseMoeBlock(Layer):
    """The router (``gate``, replicated under tensor parallel) and the experts of one layer, HF's
    module names. Kernel slot ``router``: a device backend's, routing instead of the torch code."""

    kernel_slots = ("router",)
    router: RouterImpl | None = None

    def __init__(self, hidden: int, act: str, moe: MoeArgs) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.gate = Linear(hidden, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, hidden, moe.inner, act)

    def options(self) -> dict[str, Any]:
        return {"top_k": self.top_k, "norm_topk_prob": self.norm_topk_prob}

    def route(self, x: torch.Tensor) -> ExpertGroups:
        """Each row's top-k experts and their probabilities, grouped by expert."""
        if self.router is not None:
            expert_ids, weights = self.router(x.contiguous())
            return self.experts.group(expert_ids, weights)
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        top, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return self.experts.group(expert_ids, top.to(x.dtype))

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + moe(x)``."""
        return residual + self.experts(x, self.route(x))


class MoeForCausalLM(LlamaForCausalLM):
    """Llama's decoder whose sparse layers (``MoeArgs.sparse_layers``) run a ``SparseMoeBlock``."""

    def feed_forward(self, hf_config: Any, layer: int) -> FeedForward:
        moe = MoeArgs.from_hf(hf_config)
        if not moe.sparse_layers[layer]:
            return MLP(self.args)
        return SparseMoeBlock(self.args.hidden_size, self.args.act, moe)


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE causal LM over the paged KV pool."""


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral causal LM over the paged KV pool. Its checkpoint names the block ``block_sparse_moe``
    and an expert's projections w1 (gate), w3 (up), w2 (down)."""

    checkpoint_renames = (
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
        (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."),
        (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."),
    )
