"""DeepSeek's mixture of experts (DeepSeek-V2/V3, GLM-4.7-Flash): shared experts beside the routed
ones, and its routers.

The router (``gate``: HF's weight, and V3's ``e_score_correction_bias``) scores the experts in float32
as HF does in every dtype:
- scoring: ``softmax`` (V2) or ``sigmoid`` (V3, GLM) of the logits;
- group-limited selection (``n_group`` > 1 with ``topk_group``): only the experts of the best
  ``topk_group`` groups are chosen from, a group scored by its best expert (V2's
  ``group_limited_greedy``) or its two best, bias included (V3, GLM);
- V3's score-correction bias joins the scores for the selection alone; the weights are the
  scores themselves;
- ``norm_topk_prob`` (V3, GLM; V2's router never renormalises) makes a token's k weights sum to 1,
  then every weight is multiplied by ``routed_scaling_factor``.

A token's output is its routed experts' weighted sum plus the shared experts' (one SwiGLU MLP of
``n_shared_experts`` experts' width), added as HF adds them. The experts are moe.py's ``Experts``
(rows grouped by expert, a GGUF's blocks, expert parallel under --tp-size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.models.contract import Layer
from gpu_worker.models.llama import MLP
from gpu_worker.models.moe import Experts, RouterImpl


@dataclass(frozen=True)
class RouterArgs:
    num_experts: int
    top_k: int
    scoring: str  # softmax | sigmoid
    num_groups: int  # 1: no group limit
    topk_groups: int
    group_score: str  # max (V2) | top2 (V3, GLM: the sum of a group's two best)
    bias: bool  # V3's e_score_correction_bias
    norm_topk_prob: bool
    scaling: float  # routed_scaling_factor

    @classmethod
    def from_hf(cls, cfg: Any) -> RouterArgs:
        v2 = cfg.model_type == "deepseek_v2"
        groups = int(getattr(cfg, "n_group", None) or 1)
        if v2 and getattr(cfg, "topk_method", "greedy") != "group_limited_greedy":
            groups = 1
        return cls(
            num_experts=int(cfg.n_routed_experts),
            top_k=int(cfg.num_experts_per_tok),
            scoring="softmax" if v2 else "sigmoid",
            num_groups=groups,
            topk_groups=int(getattr(cfg, "topk_group", None) or 1),
            group_score="max" if v2 else "top2",
            bias=not v2,
            norm_topk_prob=not v2 and bool(getattr(cfg, "norm_topk_prob", False)),
            scaling=float(getattr(cfg, "routed_scaling_factor", None) or 1.0),
        )

    def options(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "num_experts"}


class DeepseekRouter(Layer):
    """``gate``: each token's top-k experts and their weights (module docstring), whole on every rank.
    ``route``: a backend's softmax top-k in one call (moe.py's ``RouterImpl``), for a router that
    is no more than that (V2's without groups); ``routed_scaling_factor`` is applied here."""

    kernel_slots = ("route",)
    route: RouterImpl | None = None

    def __init__(self, hidden: int, args: RouterArgs) -> None:
        super().__init__()
        self.args = args
        self.weight = nn.Parameter(torch.empty(args.num_experts, hidden), requires_grad=False)
        if args.bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(args.num_experts), requires_grad=False)

    def options(self) -> dict[str, Any]:
        return self.args.options()

    @property
    def plain_softmax(self) -> bool:
        """Whether the router is a softmax top-k alone (what ``route`` may compute)."""
        a = self.args
        return a.scoring == "softmax" and a.num_groups == 1 and not a.bias and not a.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids [T, k] and their weights [T, k] (float32; ``route``'s: x's dtype)."""
        a = self.args
        if self.route is not None:
            expert_ids, weights = self.route(x)
            return expert_ids, weights if a.scaling == 1.0 else weights * a.scaling
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(dim=-1) if a.scoring == "softmax" else logits.sigmoid()
        choice = scores
        if a.bias:  # added at the wider of float32 and its own dtype, as HF's float32 buffer is
            bias = self.e_score_correction_bias
            choice = scores + bias.to(torch.promote_types(bias.dtype, torch.float32))
        if a.num_groups > 1:
            choice = self._within_best_groups(choice)
        if a.bias:
            expert_ids = torch.topk(choice, a.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, expert_ids)
        else:
            weights, expert_ids = torch.topk(choice, a.top_k, dim=-1, sorted=False)
        if a.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return expert_ids, weights * a.scaling

    def _within_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` with the experts outside each token's best ``topk_groups`` groups masked out
        (-inf under V3's bias, where only the selection reads it; 0 under V2's softmax, as HF)."""
        a = self.args
        grouped = choice.view(-1, a.num_groups, a.num_experts // a.num_groups)
        if a.group_score == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        best = torch.topk(group_scores, k=a.topk_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(choice.shape)
        return choice.masked_fill(~keep, float("-inf") if a.bias else 0.0)


class DeepseekMoe(Layer):
    """One layer's routed experts, router and shared experts (HF's module names)."""

    def __init__(self, hidden: int, inner: int, act: str, router: RouterArgs, shared: MLP | None) -> None:
        super().__init__()
        self.gate = DeepseekRouter(hidden, router)
        self.experts = Experts(router.num_experts, hidden, inner, act)
        if shared is not None:
            self.shared_experts = shared
        self.has_shared = shared is not None

    def options(self) -> dict[str, Any]:
        return {"shared": self.has_shared}

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + (routed(x) + shared(x))``, HF's order of the adds."""
        expert_ids, weights = self.gate(x)
        routed = self.experts(x, self.experts.group(expert_ids, weights.to(x.dtype)))
        if self.has_shared:
            routed = self.shared_experts.add_to(routed, x)
        return residual + routed
