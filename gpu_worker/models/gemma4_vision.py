"""Gemma 4's vision tower: its own encoder over an image's patches (a linear patch embedder with a
learned x and y position table, axial 2D rope, RMS norms on q, k and v, gated GELU MLPs), a pooler
averaging k x k patches by their grid positions, and the projector into the language model (a
scale-free RMS norm, a matmul). Each mirrors HF's op order and its dtypes (Gemma4VisionModel,
Gemma4MultimodalEmbedder): the norms, rope angles and pooling run in float32 as HF's do.

The processor pads every image's patches to one count (its patch budget) and gives each patch its
(x, y) grid position, -1 for padding; the tokenizer appends the two positions to each patch's pixels
(tokenizer_proc/images.py), so one pixel tensor carries both. An image's token count follows its
aspect ratio: the tower returns one tensor per image.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.models.layers import activation


class RMSNorm(nn.Module):
    """HF's Gemma4RMSNorm: float32 inside, ``pow(., -0.5)``, an optional plain scale."""

    def __init__(self, dim: int, eps: float, scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (out if self.weight is None else out * self.weight.float()).type_as(x)


class ClippableLinear(nn.Module):
    """A bias-free linear whose input and output are clamped to the checkpoint's bounds when the
    config says so (HF's Gemma4ClippableLinear; its bounds are scalars saved with the weights)."""

    def __init__(self, cfg: Any, rows_in: int, rows_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(rows_in, rows_out, bias=False)
        self.clipped = bool(cfg.use_clipped_linears)
        if self.clipped:
            self.input_min, self.input_max = _bound(), _bound()
            self.output_min, self.output_max = _bound(), _bound()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        x = self.linear(torch.clamp(x, self.input_min, self.input_max))
        return torch.clamp(x, self.output_min, self.output_max)


def _bound() -> nn.Parameter:
    return nn.Parameter(torch.empty(()), requires_grad=False)


def axial_rope(cfg: Any, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, P, head_dim] of the patches' (x, y) positions: the same frequencies for both
    axes over a quarter of the head each, laid out x, x, y, y (HF computes them in float32)."""
    spatial = cfg.head_dim // 2
    base = cfg.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
    freqs = positions[..., None].float() * inv_freq.to(positions.device)  # [B, P, 2, head_dim / 4]
    cos, sin = freqs.cos(), freqs.sin()
    cos = torch.cat([cos[:, :, 0], cos[:, :, 0], cos[:, :, 1], cos[:, :, 1]], dim=-1)
    sin = torch.cat([sin[:, :, 0], sin[:, :, 0], sin[:, :, 1], sin[:, :, 1]], dim=-1)
    return cos.to(dtype), sin.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope on [B, P, heads, D]: each half of the head its axis's rotate-half rope."""
    half = x.shape[-1] // 2
    out = []
    for part in range(2):
        piece = slice(part * half, (part + 1) * half)
        xs, c, s = x[..., piece], cos[..., piece].unsqueeze(2), sin[..., piece].unsqueeze(2)
        rotated = torch.cat((-xs[..., half // 2 :], xs[..., : half // 2]), dim=-1)
        out.append(xs * c + rotated * s)
    return torch.cat(out, dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        dim, heads = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
        kv = cfg.num_key_value_heads * cfg.head_dim
        self.q_proj, self.k_proj = ClippableLinear(cfg, dim, heads), ClippableLinear(cfg, dim, kv)
        self.v_proj, self.o_proj = ClippableLinear(cfg, dim, kv), ClippableLinear(cfg, heads, dim)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.v_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, scale=False)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], valid: torch.Tensor
    ) -> torch.Tensor:
        batch, patches, _ = x.shape
        q = _rotate(self.q_norm(self.q_proj(x).view(batch, patches, -1, self.head_dim)), *rope)
        k = _rotate(self.k_norm(self.k_proj(x).view(batch, patches, -1, self.head_dim)), *rope)
        v = self.v_norm(self.v_proj(x).view(batch, patches, -1, self.head_dim))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        # Every patch sees every real patch of its image, none of the padding; q and k are normed,
        # so the scores are unscaled.
        mask = valid[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        return self.o_proj(out.transpose(1, 2).reshape(batch, patches, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.gate_proj = ClippableLinear(cfg, cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = ClippableLinear(cfg, cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = ClippableLinear(cfg, cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionEncoderLayer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn, self.mlp = VisionAttention(cfg), VisionMLP(cfg)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(dim, eps), RMSNorm(dim, eps)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = RMSNorm(dim, eps), RMSNorm(dim, eps)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], valid: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, valid))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class PatchEmbedder(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.input_proj = nn.Linear(3 * cfg.patch_size**2, cfg.hidden_size, bias=False)
        self.position_embedding_table = nn.Parameter(
            torch.empty(2, cfg.position_embedding_size, cfg.hidden_size)
        )

    def forward(self, patches: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        # Pixels in [0, 1] to [-1, 1], in the processor's float32 as HF takes them.
        x = self.input_proj((2 * (patches.float() - 0.5)).to(self.input_proj.weight.dtype))
        at = positions.clamp(min=0)
        table = self.position_embedding_table
        where = F.embedding(at[..., 0], table[0]) + F.embedding(at[..., 1], table[1])
        return x + torch.where(padding.unsqueeze(-1), 0.0, where)


class VisionEncoder(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        rope = axial_rope(self.cfg, positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, valid)
        return x


def pool(x: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor, length: int) -> torch.Tensor:
    """[B, length, D] float32: each output the mean of its k x k block of patches by grid position
    (padding patches are zero and fall in no block a real patch does), times sqrt(D), as HF's
    Gemma4VisionPooler computes it (a one-hot float32 matmul)."""
    x = x.masked_fill(padding.unsqueeze(-1), 0.0)
    if x.shape[1] != length:
        k = int((x.shape[1] // length) ** 0.5)
        at = positions.clamp(min=0)
        width = at[..., 0].max(dim=-1, keepdim=True)[0] + 1
        block = torch.div(at, k, rounding_mode="floor")
        weights = F.one_hot((block[..., 0] + (width // k) * block[..., 1]).long(), length).float() / k**2
        x = (weights.transpose(1, 2) @ x.float()).to(x.dtype)
    return x.float() * x.shape[-1] ** 0.5


class Gemma4VisionModel(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embedder = PatchEmbedder(cfg)
        self.encoder = VisionEncoder(cfg)
        if cfg.standardize:
            self.std_bias = nn.Parameter(torch.empty(cfg.hidden_size), requires_grad=False)
            self.std_scale = nn.Parameter(torch.empty(cfg.hidden_size), requires_grad=False)

    def forward(self, patches: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the pooled tokens of every image, concatenated [N, D]; each image's token count [B])."""
        padding = (positions == -1).all(dim=-1)
        x = self.encoder(self.patch_embedder(patches, positions, padding), positions, ~padding)
        k2 = self.cfg.pooling_kernel_size**2
        pooled = pool(x, positions, padding, patches.shape[1] // k2)
        counts = (~padding).sum(dim=-1) // k2
        # The blocks with a real patch come first: an image's tokens are its first ``count``.
        keep = torch.arange(pooled.shape[1], device=pooled.device)[None, :] < counts[:, None]
        tokens = pooled[keep]
        if self.cfg.standardize:
            tokens = (tokens - self.std_bias.float()) * self.std_scale.float()
        return tokens.to(x.dtype), counts


class Gemma4MultimodalEmbedder(nn.Module):
    def __init__(self, vision: Any, text: Any) -> None:
        super().__init__()
        self.embedding_pre_projection_norm = RMSNorm(vision.hidden_size, vision.rms_norm_eps, scale=False)
        self.embedding_projection = nn.Linear(vision.hidden_size, text.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(x))


class Gemma4VisionTower(nn.Module):
    """pixels [B, patches, 3 p^2 + 2] (each patch's pixels, then its x and y; -1 for padding) ->
    one [tokens, text hidden] per image, in place of its image tokens (after the text embeddings'
    scale, which they do not get)."""

    checkpoint_renames = (
        (r"^(model\.)?vision_tower\.", "vision_tower."),
        (r"^(model\.)?embed_vision\.", "embed_vision."),
    )
    checkpoint_skipped = r"^(?!(model\.)?(vision_tower|embed_vision)\.)"

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.vision_tower = Gemma4VisionModel(hf_config.vision_config)
        self.embed_vision = Gemma4MultimodalEmbedder(hf_config.vision_config, hf_config.get_text_config())
        cfg = hf_config.vision_config
        self.tokens_per_image = 0  # an image's count follows its aspect ratio (at most the budget)
        # HF lets an image's tokens see each other both ways where the text config says "vision"
        # (on sliding layers only: gemma4.py keeps the global layers causal), else causally.
        text = hf_config.get_text_config()
        self.bidirectional = getattr(text, "use_bidirectional_attention", None) == "vision"
        self.patch_values = 3 * cfg.patch_size**2

    def forward(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        patches, positions = pixels[..., : self.patch_values], pixels[..., self.patch_values :]
        tokens, counts = self.vision_tower(patches, positions.round().long())
        return list(torch.split(self.embed_vision(tokens), counts.tolist()))
