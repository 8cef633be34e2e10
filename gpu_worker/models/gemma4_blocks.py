"""Gemma 4's blocks beside its attention (gemma4.py): its RMSNorm, the MLP, and the router and
stacked experts of the MoE block that runs beside the MLP. Each mirrors HF's op order (float64 runs
match it to ~1e-12).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gpu_worker.models.contract import Layer, Split
from gpu_worker.models.layers import FusedOps, Linear, MergedLinear, activation, gelu_tanh
from gpu_worker.models.moe import Experts


class Gemma4RMSNorm(Layer):
    """``norm(x) * w`` (Gemma 4 scales by w, not Gemma 2/3's 1 + w), or no scale at all
    (``with_scale=False``: the norm on v, the router's); statistics and scale in float32, rounded
    once to x's dtype, the inverse root as ``pow(., -0.5)`` as HF takes it.

    Kernel slot ``fused``: a device backend's RMSNorm, one call on float32 activations (within
    float32 rounding of the torch ops, which take ~8 passes), over w or, with no scale, ones (a
    product by 1 is exact). In bf16 the torch path runs (it rounds once, after the scale)."""

    kernel_slots = ("fused",)
    fused: FusedOps | None = None
    scale32: torch.Tensor | None = None  # the kernel's weight (w, or ones), while one is attached

    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False) if with_scale else None
        self.eps, self.dim = eps, dim

    def options(self) -> dict[str, Any]:
        return {"with_scale": self.weight is not None}

    def attach(self, **kernels: Any) -> None:
        super().attach(**kernels)
        scale = None
        if self.fused is not None:
            scale = torch.ones(self.dim) if self.weight is None else self.weight.detach().float().contiguous()
        object.__setattr__(self, "scale32", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and self.scale32 is not None and x.dtype == torch.float32:
            rows = x.reshape(-1, x.shape[-1])
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
            return self.fused.rms_norm(rows, self.scale32, self.eps).view(x.shape)
        x32 = x.float()
        normed = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            normed = normed * self.weight.float()
        return normed.type_as(x)


class Gemma4MLP(Layer):
    """act(gate) * up, down: Gemma 3's MLP, ``inner`` wide (twice the config's on the KV-shared
    layers of a ``use_double_wide_mlp`` model). Kernel slot ``fused``: GELU-tanh's gate and product
    in one call on float32 (GemmaMLP's)."""

    kernel_slots = ("fused",)
    fused: FusedOps | None = None

    def __init__(self, hidden: int, inner: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, {"gate_proj": inner, "up_proj": inner}, False)
        self.down_proj = Linear(inner, hidden, False, Split.ROW)
        self.act = activation(act)

    def options(self) -> dict[str, Any]:
        return {"act": self.act}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused is not None and self.act is gelu_tanh and gate_up.dtype == torch.float32:
            return self.down_proj(self.fused.gelu_tanh_mul(gate_up.reshape(-1, gate_up.shape[-1])))
        gate, up = gate_up.chunk(2, dim=-1)
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


class LogitSoftcap(Layer):
    """Final logits soft-capped, ``cap * tanh(x / cap)``, in place (the LM head's fresh output).
    Kernel slot ``fused``: a device backend's one pass on float32 (within float32 rounding of
    torch's tanh) for torch's three over the vocabulary."""

    kernel_slots = ("fused",)
    fused: FusedOps | None = None

    def __init__(self, cap: float) -> None:
        super().__init__()
        self.cap = cap

    def options(self) -> dict[str, Any]:
        return {"cap": self.cap}

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and logits.dtype == torch.float32 and logits.is_contiguous():
            self.fused.softcap_(logits, self.cap)
            return logits
        return logits.div_(self.cap).tanh_().mul_(self.cap)


def hf_scale(value: float) -> torch.Tensor:
    """A scale as HF's embedding buffer holds it: rounded to float32, then to the model's dtype."""
    return torch.tensor(value, dtype=torch.float32).to(torch.get_default_dtype())
