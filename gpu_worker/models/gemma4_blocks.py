"""Gemma 4's blocks beside its attention (gemma4.py): its RMSNorm, the MLP, and the router and
stacked experts of the MoE block that runs beside the MLP. Each mirrors HF's op order (float64 runs
match it to ~1e-12).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gpu_worker.models.contract import Layer, Split
from gpu_worker.models.layers import Linear, MergedLinear, activation
from gpu_worker.models.moe import Experts


class Gemma4RMSNorm(Layer):
    """``norm(x) * w`` (Gemma 4 scales by w, not Gemma 2/3's 1 + w), or no scale at all
    (``with_scale=False``: the norm on v, the router's); statistics and scale in float32, rounded
    once to x's dtype, the inverse root as ``pow(., -0.5)`` as HF takes it."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False) if with_scale else None
        self.eps = eps

    def options(self) -> dict[str, Any]:
        return {"with_scale": self.weight is not None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            normed = normed * self.weight.float()
        return normed.type_as(x)


class Gemma4MLP(Layer):
    """act(gate) * up, down: Gemma 3's MLP, ``inner`` wide (twice the config's on the KV-shared
    layers of a ``use_double_wide_mlp`` model)."""

    def __init__(self, hidden: int, inner: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, {"gate_proj": inner, "up_proj": inner}, False)
        self.down_proj = Linear(inner, hidden, False, Split.ROW)
        self.act = activation(act)

    def options(self) -> dict[str, Any]:
        return {"act": self.act}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class StackedExperts(Experts):
    """Experts whose checkpoint holds them stacked, as the parameters are (``experts.gate_up_proj``
    [E, 2 * inner, hidden], gate rows first; ``experts.down_proj`` [E, hidden, inner]); a GGUF's
    fill them per projection as other families' do (gguf_gemma4.py splits its gate_up)."""

    def checkpoint_views(self) -> dict[str, torch.Tensor]:
        return {"gate_up_proj": self.gate_up_proj, "down_proj": self.down_proj}

    def gguf_views(self) -> dict[str, torch.Tensor]:
        return Experts.checkpoint_views(self)


class Gemma4Router(Layer):
    """Gemma 4's router: the residual stream RMS-normed without a scale, times ``scale`` and
    1/sqrt(hidden), to E logits; softmax in float32 over all E, the top k renormalised to sum to 1,
    each then times its expert's ``per_expert_scale``."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, eps: float) -> None:
        super().__init__()
        self.top_k, self.root_size = top_k, hidden**-0.5
        self.norm = Gemma4RMSNorm(hidden, eps, with_scale=False)
        self.proj = Linear(hidden, num_experts, bias=False)
        self.scale = nn.Parameter(torch.empty(hidden), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.empty(num_experts), requires_grad=False)

    def options(self) -> dict[str, Any]:
        return {"top_k": self.top_k}

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k expert ids [T, k] and their weights [T, k] (float32 promoted by the
        scales' dtype, as HF's)."""
        scores = self.proj(self.norm(x) * self.scale * self.root_size)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        top, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        top /= top.sum(dim=-1, keepdim=True)
        return expert_ids, top * self.per_expert_scale[expert_ids]


def hf_scale(value: float) -> torch.Tensor:
    """A scale as HF's embedding buffer holds it: rounded to float32, then to the model's dtype."""
    return torch.tensor(value, dtype=torch.float32).to(torch.get_default_dtype())
