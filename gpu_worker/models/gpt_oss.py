"""gpt-oss: Llama's decoder (llama.py) with a learned attention sink per head, sliding-window and
full layers alternating (``layer_types``), YaRN rope, biases on q/k/v/o, and a sparse block on every
layer (moe.py's grouping by expert) whose parts differ from Qwen3-MoE's and Mixtral's:
- the router has a bias, and its softmax is taken over each token's top-k logits alone;
- each expert has biases on its two projections, its gate and up rows interleaved (row 2j gate j,
  row 2j + 1 up j, as the checkpoint holds them), and a clamped SwiGLU: the gate clamped from above
  and the up from both sides at ``swiglu_limit``, ``(up + 1) * gate * sigmoid(alpha * gate)``.

The checkpoint holds the experts stacked and transposed ([E, in, out], HF's memory layout); the
parameters here are [E, out, in] like moe.py's, filled through transposed views.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.forward_context import ForwardContext, paged_attention
from gpu_worker.models.contract import Layer
from gpu_worker.models.layers import Linear
from gpu_worker.models.llama import Attention, DecoderLayer, FeedForward, LlamaArgs, LlamaForCausalLM
from gpu_worker.models.moe import ExpertGroups, Experts, MoeArgs, SparseMoeBlock

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # gpt-oss's, where a config states none


class SinkAttention(Attention):
    """Llama's attention with a learned sink logit per query head (``sinks``, [Hq]): one more logit
    in each softmax, with no value."""

    def __init__(self, args: LlamaArgs, layer: int) -> None:
        super().__init__(args, layer)
        self.sinks = nn.Parameter(torch.empty(args.num_heads), requires_grad=False)

    def options(self) -> dict[str, Any]:
        return {**super().options(), "sinks": True}


class SinkDecoderLayer(DecoderLayer):
    """Llama's decoder layer over ``SinkAttention``: the sinks join the layer's attention options."""

    attention_type = SinkAttention
    self_attn: SinkAttention

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        q, k, v = self.self_attn.project(self.input_layernorm(x), cos, sin)
        options = replace(self.attention, sinks=self.self_attn.sinks)  # as loaded and split
        attended = paged_attention(self.layer, q, k, v, ctx, options)
        x = self.self_attn.o_proj.add_to(x, attended.flatten(1))
        return self.mlp.add_to(x, self.post_attention_layernorm(x))


class ClampedSwigluExperts(Experts):
    """E experts with biases, gate/up rows interleaved and the clamped SwiGLU (module docstring)."""

    def __init__(self, num_experts: int, hidden: int, inner: int, alpha: float, limit: float) -> None:
        super().__init__(num_experts, hidden, inner, "silu")
        self.act = self.act_mul  # not silu: no fast path takes these experts for SiLU ones
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * inner), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)

    def options(self) -> dict[str, Any]:
        return {"act": "clamped_swiglu", "alpha": self.alpha, "limit": self.limit, "bias": True}

    def checkpoint_views(self) -> dict[str, torch.Tensor]:
        """The checkpoint's stacked, transposed tensors -> the parameters they fill."""
        return {
            "gate_up_proj": self.gate_up_proj.transpose(1, 2),
            "gate_up_proj_bias": self.gate_up_proj_bias,
            "down_proj": self.down_proj.transpose(1, 2),
            "down_proj_bias": self.down_proj_bias,
        }

    def gguf_views(self) -> dict[str, torch.Tensor]:
        """A GGUF's tensors (gate and up apart, [out, in] per expert) -> the rows they fill."""
        views: dict[str, torch.Tensor] = {
            "gate_proj.bias": self.gate_up_proj_bias[:, 0::2],
            "up_proj.bias": self.gate_up_proj_bias[:, 1::2],
            "down_proj.bias": self.down_proj_bias,
        }
        for e in range(self.num_experts):
            views[f"{e}.gate_proj.weight"] = self.gate_up_proj[e, 0::2]
            views[f"{e}.up_proj.weight"] = self.gate_up_proj[e, 1::2]
            views[f"{e}.down_proj.weight"] = self.down_proj[e]
        return views

    def split_biases(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[E, 2 * inner] gate biases then up biases (the order of blocks held as gate, up), [E, hidden]."""
        bias = self.gate_up_proj_bias
        return torch.cat((bias[:, 0::2], bias[:, 1::2]), dim=1), self.down_proj_bias

    def compute(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        assert self.quantized is None, "stacked blocks are computed by a backend's impl alone"
        rows = x.index_select(0, groups.tokens)
        out = torch.empty_like(rows)
        for expert, start, count in groups.spans.tolist():
            gate_up = F.linear(
                rows[start : start + count], self.gate_up_proj[expert], self.gate_up_proj_bias[expert]
            )
            out[start : start + count] = F.linear(
                self.act_mul(gate_up), self.down_proj[expert], self.down_proj_bias[expert]
            )
        return groups.combine(out)

    def act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``(up + 1) * gate * sigmoid(alpha * gate)`` of interleaved [rows, 2 * inner], clamped."""
        return self.glu(gate_up[..., ::2], gate_up[..., 1::2])

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The clamped SwiGLU of ``gate`` and ``up`` ([rows, inner] each)."""
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class TopKSoftmaxMoeBlock(SparseMoeBlock):
    """A sparse block whose router (``gate``, with a bias) softmaxes each token's top-k logits."""

    def __init__(self, hidden: int, moe: MoeArgs, alpha: float, limit: float) -> None:
        Layer.__init__(self)  # its own router and experts, not SparseMoeBlock's unbiased SiLU ones
        self.top_k, self.norm_topk_prob = moe.top_k, True  # the top-k softmax sums to 1 by itself
        self.gate = Linear(hidden, moe.num_experts, bias=True)
        self.experts = ClampedSwigluExperts(moe.num_experts, hidden, moe.inner, alpha, limit)

    def options(self) -> dict[str, Any]:
        return {"top_k": self.top_k, "softmax": "top_k"}

    def route(self, x: torch.Tensor) -> ExpertGroups:
        if self.router is not None:
            expert_ids, weights = self.router(x.contiguous())
            return self.experts.group(expert_ids, weights)
        top, expert_ids = torch.topk(self.gate(x), self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
        return ExpertGroups.of(expert_ids, weights.to(x.dtype), self.experts.routed_experts)


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss causal LM over the paged KV pool. Its checkpoint names the router ``router`` (ours:
    ``gate``, as the other sparse blocks)."""

    checkpoint_renames = ((r"\.mlp\.router\.", ".mlp.gate."),)
    decoder_layer = SinkDecoderLayer

    def feed_forward(self, hf_config: Any, layer: int) -> FeedForward:
        moe = MoeArgs.from_hf(hf_config)
        # (transformers before 5.24 states no alpha: gpt-oss's 1.702, as its modeling code had it)
        alpha = float(getattr(hf_config, "swiglu_alpha", SWIGLU_ALPHA))
        limit = float(getattr(hf_config, "swiglu_limit", SWIGLU_LIMIT))
        return TopKSoftmaxMoeBlock(self.args.hidden_size, moe, alpha, limit)
