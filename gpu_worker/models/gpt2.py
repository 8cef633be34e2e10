"""GPT-2: LayerNorm, learned positions, fused q/k/v, GELU MLP, tied lm_head.

HF's checkpoint holds the projections as Conv1D weights, [in, out]; ours are Linears, [out, in], as a
GGUF holds them (llama.cpp's converter transposes them), so the backends' matmuls and a GGUF's blocks
serve GPT-2 as they serve the other families. The safetensors loader transposes the checkpoint's
(``checkpoint_transposed``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gpu_worker.forward_context import ForwardContext, paged_attention
from gpu_worker.models.contract import AttentionLayer, Layer, Split
from gpu_worker.models.layers import Embedding, LayerNorm, Linear, MergedLinear, activation


class GPT2Attention(AttentionLayer):
    def __init__(self, cfg: Any, layer: int) -> None:
        super().__init__()
        self.layer, self.num_heads, self.num_kv_heads = layer, cfg.n_head, cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        hidden = cfg.n_embd
        # q, k, v rows in turn, one checkpoint tensor (tensor parallel splits each block)
        self.c_attn = MergedLinear(
            hidden, {"q": hidden, "k": hidden, "v": hidden}, True, fused_checkpoint=True
        )
        self.c_proj = Linear(hidden, hidden, True, Split.ROW)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.c_attn(x).view(tokens, 3, self.num_heads, self.head_dim).unbind(1)
        out = paged_attention(self.layer, q, k, v, ctx)
        return self.c_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class GPT2MLP(Layer):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        inner = cfg.n_inner or 4 * cfg.n_embd
        self.c_fc = Linear(cfg.n_embd, inner, True, Split.COLUMN)
        self.c_proj = Linear(inner, cfg.n_embd, True, Split.ROW)
        self.act = activation(cfg.activation_function)

    def options(self) -> dict[str, Any]:
        return {"act": self.act}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(Layer):
    def __init__(self, cfg: Any, layer: int) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon)
        self.attn = GPT2Attention(cfg, layer)
        self.ln_2 = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), ctx)
        return x + self.mlp(self.ln_2(x))


class GPT2Body(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(GPT2Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon)


class GPT2LMHeadModel(nn.Module):
    """GPT-2 causal LM over the paged KV pool."""

    tensor_parallel: tuple[int, int] | None = None  # (rank, world): tensor_parallel.shard's

    # Original OpenAI checkpoints name weights without the "transformer." prefix.
    checkpoint_prefix = "transformer."
    # The checkpoint's Conv1D weights, [in, out]: the loader transposes them into our Linears.
    checkpoint_transposed = r"\.(c_attn|c_proj|c_fc)\.weight$"

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        assert not getattr(cfg, "scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx"
        assert not getattr(cfg, "reorder_and_upcast_attn", False), "reorder_and_upcast_attn is not supported"
        assert getattr(cfg, "scale_attn_weights", True), "unscaled attention is not supported"
        self.num_layers, self.num_kv_heads, self.num_heads = cfg.n_layer, cfg.n_head, cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.context_len = cfg.n_positions
        self.transformer = GPT2Body(cfg)
        self.lm_head = Linear(cfg.n_embd, cfg.vocab_size, False, Split.VOCAB)
        if getattr(cfg, "tie_word_embeddings", True):
            self.lm_head.weight = self.transformer.wte.weight

    def decoder_layers(self) -> nn.ModuleList:
        return self.transformer.h

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states [T, hidden] before the final LayerNorm."""
        x = self.transformer.wte(input_ids) + self.transformer.wpe(ctx.positions)
        for block in self.transformer.h:
            x = block(x, ctx)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer.ln_f(hidden))
