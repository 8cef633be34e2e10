"""The Gated DeltaNet block: the linear-attention layer of Qwen3.5 and Qwen3-Next, which keeps a
fixed-size recurrent state per request (gpu_worker/recurrent_state.py) instead of a KV cache.

As HF computes it: the hidden states project to q, k, v (one ``conv_channels`` block), the output gate
z [H_v, d_v] and per value head b and a; q, k, v pass a causal depthwise conv1d (kernel 4, no bias)
and SiLU; beta = sigmoid(b), the log-decay g = -exp(A_log) * softplus(a + dt_bias); the gated delta
rule (delta_rule.py) reads and updates the state; each value head's output is RMS-normed, scaled
by w (not 1 + w) and gated by silu(z); ``out_proj`` maps it back to the hidden size.

Three checkpoint layouts (``layout``): ``split``, Qwen3.5's ``in_proj_qkv``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a`` (one merged matmul here, q then k then v over all heads); ``grouped``,
Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba``, grouped per key head (each key head's q, k, then its
value heads' v and z; its value heads' b, then a), reordered after the matmul; ``split_ba``, a
Qwen3-Next GGUF's: q/k/v and z split as Qwen3.5's, b and a still grouped in ``in_proj_ba``.
``tiled_values``: value head h reads key head h % H_k, not h // (H_v / H_k) (a Qwen3.5 GGUF, whose
converter reorders the value heads so; the same model, its heads numbered otherwise).

Kernel slots (a backend fills them in ``prepare_model``, e.g. backends/cpu/prepare.py):
- ``recurrent_rule``: the one-token state update of the decode rows, all rows in one call;
- ``chunked_rule``: the chunked form over one prefill row's tokens;
- ``pooled_rule``: both forms of the rule over the state pool in place, every row at once, and
  ``pooled_conv`` the conv1d likewise (gated_delta_pooled.py); used for float32 and bfloat16
  activations before the other two (the conv1d's torch code runs where ``pooled_conv`` is empty);
- ``decode_step``: for float32 steps whose rows all decode one token, everything between the
  projections (conv1d, gates, rule, gated norm) in one call over both pools: a step of small ops
  costs a one-row decode more than the rule itself does.
Both take and return what transformers' ``torch_recurrent_gated_delta_rule`` /
``torch_chunk_gated_delta_rule`` do (``DeltaRule``), called with keywords ``initial_state`` (the
rows' float32 states [B, H_v, d_k, d_v], gathered from the pool), ``output_final_state=True`` and
``use_qk_l2norm_in_kernel=True``; q, k, v, g and beta arrive as float32 [B, T, H, d] / [B, T, H].
The layer writes the returned state back to the pool. Empty slots run delta_rule.py's torch code.
Tensor parallel does not split this layer (tensor_parallel.py refuses hybrid models).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.models import delta_rule, gated_delta_pooled
from gpu_worker.models.contract import Layer, Split
from gpu_worker.models.layers import Linear, MergedLinear
from gpu_worker.recurrent_state import StateShape

if TYPE_CHECKING:
    from gpu_worker.forward_context import ForwardContext
    from gpu_worker.models.gated_delta_pooled import DecodeStep, PooledConv, PooledRule
    from gpu_worker.recurrent_state import RecurrentBatch


class DeltaRule(Protocol):
    """transformers' signature of the gated delta rule (delta_rule.py's module docstring)."""

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
        beta: torch.Tensor, *, initial_state: torch.Tensor | None, output_final_state: bool,
        use_qk_l2norm_in_kernel: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...  # fmt: skip


class CausalConv1d(Layer):
    """The depthwise conv1d's weight [channels, 1, kernel] (HF's ``nn.Conv1d`` name and shape)."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)


class GatedRMSNorm(Layer):
    """``w * norm(x) * silu(z)`` per value head, the statistics and the gate in float32 (HF's order)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed.to(x.dtype) * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(Layer):
    """One linear-attention layer; ``index`` is its place among the model's linear layers (its
    states in the pool). Kernel slots ``recurrent_rule`` and ``chunked_rule`` (module docstring)."""

    kernel_slots = ("recurrent_rule", "chunked_rule", "pooled_rule", "pooled_conv", "decode_step")
    recurrent_rule: DeltaRule | None = None
    chunked_rule: DeltaRule | None = None
    pooled_rule: PooledRule | None = None  # the rule in place on the pool (gated_delta_pooled.py)
    pooled_conv: PooledConv | None = None  # the conv1d likewise
    decode_step: DecodeStep | None = None  # the whole block between the projections, float32 decode steps
    split = Split.REPLICATED

    def __init__(self, cfg: Any, index: int, layout: str, tiled_values: bool = False) -> None:
        super().__init__()
        self.index = index
        self.key_heads, self.value_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.d_k, self.d_v = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        key_dim, value_dim = self.key_heads * self.d_k, self.value_heads * self.d_v
        self.conv_channels = 2 * key_dim + value_dim
        self.conv_kernel = cfg.linear_conv_kernel_dim
        hidden = cfg.hidden_size
        assert layout in ("split", "grouped", "split_ba"), f"linear-attention layout {layout!r}"
        self.layout, self.tiled_values = layout, tiled_values
        heads = self.value_heads
        if layout == "grouped":  # Qwen3-Next
            self.in_proj_qkvz = Linear(hidden, self.conv_channels + value_dim, False)
        else:
            shards = {"in_proj_qkv": self.conv_channels, "in_proj_z": value_dim}
            if layout == "split":
                shards |= {"in_proj_b": heads, "in_proj_a": heads}
            self.in_proj = MergedLinear(hidden, shards, False)
        if layout != "split":
            self.in_proj_ba = Linear(hidden, 2 * heads, False)
        self.conv1d = CausalConv1d(self.conv_channels, self.conv_kernel)
        self.dt_bias = nn.Parameter(torch.empty(self.value_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.value_heads), requires_grad=False)
        self.norm = GatedRMSNorm(self.d_v, cfg.rms_norm_eps)
        self.out_proj = Linear(value_dim, hidden, False)

    def state_shape(self, layers: int) -> StateShape:
        """The recurrent state of ``layers`` layers like this one, per request."""
        return StateShape(layers, self.conv_channels, self.conv_kernel, self.value_heads, self.d_k, self.d_v)

    def options(self) -> dict[str, Any]:
        return {"layout": self.layout, "tiled_values": self.tiled_values, "conv_kernel": self.conv_kernel}

    def forward(
        self, x: torch.Tensor, ctx: ForwardContext, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The layer's output, or ``residual`` plus it (the add fused into ``out_proj`` where it can be)."""
        batch = ctx.recurrent
        assert batch is not None, "a linear-attention layer needs the batch's recurrent states"
        mixed, z, b, a = self.project(x)
        if self.decode_step is not None and x.dtype == torch.float32 and batch.step_slots is not None:
            return self.output(self.fused_step((mixed, z, b, a), batch, batch.step_slots), residual)
        kernels_fit = x.dtype in (torch.float32, torch.bfloat16)
        pooled, conv = (self.pooled_rule, self.pooled_conv) if kernels_fit else (None, None)
        if conv is not None:
            conv_states = batch.pool.conv[self.index]
            mixed = gated_delta_pooled.pooled_conv(conv, mixed, self.conv1d.weight, conv_states, batch.rounds)
        else:
            mixed = self.convolve(mixed, batch)
        q, k, v = mixed.split(
            [self.key_heads * self.d_k, self.key_heads * self.d_k, self.value_heads * self.d_v], -1
        )
        tokens = x.shape[0]
        q, k = q.view(tokens, self.key_heads, self.d_k), k.view(tokens, self.key_heads, self.d_k)
        tiled = self.tiled_values and self.key_heads < self.value_heads
        if tiled and not (pooled is not None and pooled.tiled_heads):  # one key head per value head
            q, k = (t.repeat(1, self.value_heads // self.key_heads, 1) for t in (q, k))
            tiled = False
        v = v.view(tokens, self.value_heads, self.d_v)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if pooled is not None:
            states = batch.pool.recurrent[self.index]
            qkvgb = (q, k, v, g, beta)
            out = gated_delta_pooled.pooled_delta_rule(pooled, qkvgb, states, batch.rounds, tiled)
        else:
            out = self.delta_rule(q, k, v, g, beta, batch).to(x.dtype)
        out = self.norm(out, z.view(tokens, self.value_heads, self.d_v))
        return self.output(out.flatten(1), residual)

    def output(self, y: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self.out_proj(y) if residual is None else self.out_proj.add_to(residual, y)

    def fused_step(
        self, parts: tuple[torch.Tensor, ...], batch: RecurrentBatch, slots: torch.Tensor
    ) -> torch.Tensor:
        """A decode step's block between the projections in one call of the ``decode_step`` kernel."""
        assert self.decode_step is not None
        weight = self.conv1d.weight.view(self.conv_channels, self.conv_kernel)
        params = (weight, self.A_log, self.dt_bias, self.norm.weight)
        pools = (batch.pool.conv[self.index], batch.pool.recurrent[self.index])
        tiled = self.tiled_values and self.key_heads < self.value_heads
        return self.decode_step.decode_step(parts, params, pools, slots, self.norm.eps, self.key_heads, tiled)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """mixed q/k/v [T, conv_channels] (q, k, v each over all heads), z [T, H_v d_v], b, a [T, H_v]."""
        value_dim, heads = self.value_heads * self.d_v, self.value_heads
        if self.layout == "split":
            return tuple(self.in_proj(x).split([self.conv_channels, value_dim, heads, heads], -1))  # type: ignore[return-value]
        tokens, groups, per = x.shape[0], self.key_heads, self.value_heads // self.key_heads
        b, a = self.in_proj_ba(x).view(tokens, groups, 2 * per).split([per, per], -1)
        if self.layout == "split_ba":
            mixed, z = self.in_proj(x).split([self.conv_channels, value_dim], -1)
            return mixed, z, b.flatten(1), a.flatten(1)
        qkvz = self.in_proj_qkvz(x).view(tokens, groups, -1)
        q, k, v, z = qkvz.split([self.d_k, self.d_k, per * self.d_v, per * self.d_v], -1)
        mixed = torch.cat((q.flatten(1), k.flatten(1), v.flatten(1)), dim=-1)
        return mixed, z.flatten(1), b.flatten(1), a.flatten(1)

    def convolve(self, mixed: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        """The causal conv1d and SiLU of each row from its slot's conv state, which it updates."""
        states, weight, keep = batch.pool.conv[self.index], self.conv1d.weight, self.conv_kernel - 1
        out = torch.empty_like(mixed)
        if batch.decode_rows:
            slots, tokens = batch.decode_slots(mixed.device), batch.decode_tokens(mixed.device)
            window = torch.cat((states.index_select(0, slots), mixed.index_select(0, tokens)[:, :, None]), -1)
            out[tokens] = delta_rule.causal_conv(window, weight)[:, :, 0]
            states.index_copy_(0, slots, window[:, :, 1:])
        for row in batch.prefill_rows:
            slot = batch.slots[row]
            for start, length, save_to in batch.pieces(row):
                window = torch.cat((states[slot], mixed[start : start + length].t()), dim=-1)
                out[start : start + length] = delta_rule.causal_conv(window[None], weight)[0].t()
                states[slot] = window[:, -keep:]
                if save_to is not None:  # a checkpoint inside the row (recurrent_state.py)
                    states[save_to] = states[slot]
        return out

    def delta_rule(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        batch: RecurrentBatch,
    ) -> torch.Tensor:  # fmt: skip
        """[T, H_v, d_v] float32: each row's outputs of the gated delta rule from its slot's state."""
        states = batch.pool.recurrent[self.index]
        q, k, v, g, beta = (t.to(torch.float32) for t in (q, k, v, g, beta))
        out = v.new_empty((q.shape[0], self.value_heads, self.d_v))
        rule_kwargs: dict[str, Any] = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
        if batch.decode_rows:
            slots, tokens = batch.decode_slots(q.device), batch.decode_tokens(q.device)
            step = self.recurrent_rule or delta_rule.recurrent_gated_delta_rule
            rows = [t.index_select(0, tokens)[:, None] for t in (q, k, v, g, beta)]
            got, state = step(*rows, initial_state=states.index_select(0, slots), **rule_kwargs)
            out[tokens] = got[:, 0]
            states.index_copy_(0, slots, state)  # type: ignore[arg-type]
        chunked = self.chunked_rule or delta_rule.chunk_gated_delta_rule
        for row in batch.prefill_rows:
            slot = batch.slots[row]
            for start, length, save_to in batch.pieces(row):
                span = slice(start, start + length)
                seq = [t[span][None] for t in (q, k, v, g, beta)]
                got, state = chunked(*seq, initial_state=states[slot][None], **rule_kwargs)
                out[span] = got[0]
                states[slot] = state[0]  # type: ignore[index]
                if save_to is not None:
                    states[save_to] = states[slot]
        return out
