"""Gemma 3's vision tower: a SigLIP encoder over the image's patches, then the multimodal projector
(average pooling of the patch grid to ``mm_tokens_per_image`` tokens, Gemma's RMSNorm, a matmul into
the language model's width). Each mirrors HF's op order (Gemma3Model.get_image_features).

The tower runs in torch as it stands, once per new image rather than per token: the backends'
kernels, weight layouts and tensor parallel are for the language model (every rank holds the whole
tower). SigLIP's pooling head, which Gemma 3 does not use, is not built; its weights are skipped.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.models.gemma import GemmaRMSNorm
from gpu_worker.models.layers import activation


class SiglipAttention(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        dim = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = dim // self.num_heads
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        shape = (batch, tokens, self.num_heads, self.head_dim)
        q, k, v = (proj(x).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)  # every patch sees all
        return self.out_proj(out.transpose(1, 2).reshape(batch, tokens, -1))


class SiglipMLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = SiglipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = SiglipMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        dim, patch = cfg.hidden_size, cfg.patch_size
        self.patch_embedding = nn.Conv2d(cfg.num_channels, dim, kernel_size=patch, stride=patch)
        self.position_embedding = nn.Embedding((cfg.image_size // patch) ** 2, dim)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [B, patches, dim]
        return patches + self.position_embedding.weight


class SiglipEncoder(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class SiglipVisionModel(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = SiglipEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.post_layernorm(self.encoder(self.embeddings(pixels)))


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        vision, text = cfg.vision_config, cfg.get_text_config()
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision.hidden_size, text.hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps)
        self.patches_per_side = vision.image_size // vision.patch_size
        kernel = self.patches_per_side // int(cfg.mm_tokens_per_image**0.5)
        self.avg_pool = nn.AvgPool2d(kernel_size=kernel, stride=kernel)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        batch, _, dim = patches.shape
        side = self.patches_per_side
        grid = patches.transpose(1, 2).reshape(batch, dim, side, side).contiguous()
        pooled = self.avg_pool(grid).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(patches)


class Gemma3VisionTower(nn.Module):
    """pixels [B, 3, H, W] -> embeddings [B, mm_tokens_per_image, text hidden], in place of the
    image tokens (after the text embeddings' sqrt(hidden) scale, which they do not get)."""

    # HF's names, as transformers 5 saves them (``model.vision_tower.``) or as the released
    # checkpoints have them (``vision_tower.vision_model.``).
    checkpoint_renames = (
        (r"^(model\.)?vision_tower\.(vision_model\.)?", "vision_tower."),
        (r"^(model\.)?multi_modal_projector\.", "multi_modal_projector."),
    )
    # The language model's tensors (loader.py's), and SigLIP's pooling head, which Gemma 3 leaves unused.
    # HF's Gemma 3, given the processor's token_type_ids, lets an image's tokens attend to each
    # other both ways (Gemma3Model's create_masks_for_vision_model).
    bidirectional = True
    checkpoint_skipped = (
        r"^(?!(model\.)?(vision_tower|multi_modal_projector)\.)"
        r"|^(model\.)?vision_tower\.(vision_model\.)?head\."
    )

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.vision_tower = SiglipVisionModel(hf_config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(hf_config)
        self.tokens_per_image = int(hf_config.mm_tokens_per_image)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_tower(pixels))
