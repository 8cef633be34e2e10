"""Qwen3.5's vision tower: a ViT over the image's patches (a Conv3d patch embedding, learned position
embeddings resampled bilinearly to the image's grid, axial 2D rope in every block's attention), then
the patch merger (each 2x2 block of patches into one language-model token). Each mirrors HF's op
order (Qwen3_5VisionModel), the rope in float32 as HF rotates it whatever the model's dtype.

Qwen3.5 has no deep-stack features (Qwen3-VL's taps of early vision layers added to early language
layers): the merger's output is all the language model gets.

An image's pixels come as the processor's ``pixel_values`` rows for it (one flattened
``channels x temporal_patch x patch x patch`` patch a row, the rows already in merge-block order)
shaped ``[t, h, w, patch]`` by the grid: the shape carries the grid, so images of one grid batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.models.layers import activation


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Qwen35VisionAttention(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, N, dim] (one frame's patches a row: they attend to each other only), cos/sin
        [N, head_dim] float32."""
        batch, tokens, _ = x.shape
        q, k, v = self.qkv(x).view(batch, tokens, 3, self.num_heads, self.head_dim).unbind(2)
        cos, sin = cos[:, None], sin[:, None]
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, -1))


class Qwen35VisionMLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen35VisionBlock(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = Qwen35VisionAttention(cfg)
        self.mlp = Qwen35VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class Qwen35PatchEmbed(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.shape = (cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        kernel = self.shape[1:]
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.reshape(-1, *self.shape)).flatten(1)


class Qwen35PatchMerger(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.merged = cfg.hidden_size * cfg.spatial_merge_size**2
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).reshape(-1, self.merged)  # a merge block's patches are consecutive rows
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def block_order_hw(h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's (row, column) in the grid, the patches in merge-block order (blocks row-major,
    then the patches inside a block row-major), as the processor lays them out."""
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
    return rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()


def _bilinear_taps(pos: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two table entries each of ``pos`` (0..size-1) falls between on an axis of ``side``
    entries with corners aligned, and their weights (float32, as HF computes them)."""
    src = pos.float() * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    taps = floor.long()[:, None] + torch.arange(2)
    weights = (1 - (src[:, None] - floor[:, None] - torch.arange(2)).abs()).clamp(min=0)
    return taps.clamp(0, side - 1), weights


class Qwen35VisionModel(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.merge = cfg.spatial_merge_size
        self.side = int(cfg.num_position_embeddings**0.5)
        self.patch_embed = Qwen35PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(Qwen35VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = Qwen35PatchMerger(cfg)
        rope = cfg.rope_parameters
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"Qwen3.5's vision rope is axial, the config has {rope['rope_type']!r}")
        self.rope_theta = float(rope["rope_theta"])
        self.axis_dim = cfg.hidden_size // cfg.num_heads // 2  # half the head rotates by row, half by column

    def _positions(self, h: int, w: int, device: torch.device) -> torch.Tensor:
        """[h * w, hidden]: the learned position table resampled to the grid, in block order."""
        rows, cols = block_order_hw(h, w, self.merge)
        row_taps, row_weights = _bilinear_taps(rows, h, self.side)
        col_taps, col_weights = _bilinear_taps(cols, w, self.side)
        index = (row_taps[:, :, None] * self.side + col_taps[:, None, :]).reshape(-1, 4).to(device)
        weights = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4).to(device)
        return (self.pos_embed(index) * weights[:, :, None]).sum(1)

    def _rope(self, h: int, w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = block_order_hw(h, w, self.merge)
        steps = torch.arange(0, self.axis_dim, 2, dtype=torch.float, device="cpu")
        inv_freq = 1.0 / (self.rope_theta ** (steps / self.axis_dim))
        freqs = torch.stack((rows, cols), -1)[..., None].float() * inv_freq  # [N, 2, axis_dim / 2]
        angles = torch.cat((freqs[:, 0], freqs[:, 1]), -1)
        angles = torch.cat((angles, angles), -1).to(device)
        return angles.cos(), angles.sin()

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [B, t, h, w, patch] -> merged tokens [B, t * h * w / merge^2, out hidden]."""
        batch, t, h, w, _ = patches.shape
        x = self.patch_embed(patches).view(batch, t, h * w, -1)
        x = (x + self._positions(h, w, x.device).to(x.dtype)).view(batch * t, h * w, -1)
        cos, sin = self._rope(h, w, x.device)
        for block in self.blocks:
            x = block(x, cos, sin)  # each frame attends within itself, as HF's cu_seqlens split it
        return self.merger(x).view(batch, t * h * w // self.merge**2, -1)


class Qwen35VisionTower(nn.Module):
    """pixels [B, t, h, w, patch] -> embeddings [B, t * h * w / merge^2, text hidden], in place of
    the image tokens (the language model adds no scale to its embeddings)."""

    # transformers 5 saves the tower as ``model.visual.``, as the released checkpoints have it.
    checkpoint_renames = ((r"^(model\.)?visual\.", "visual."),)
    checkpoint_skipped = r"^(?!(model\.)?visual\.)"  # the language model's tensors (loader.py's)
    bidirectional = False  # HF's Qwen3.5 masks image tokens causally like text

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.visual = Qwen35VisionModel(hf_config.vision_config)
        # The language model's 3D positions read it when its own config has no vision section.
        self.spatial_merge_size = int(hf_config.vision_config.spatial_merge_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.visual(pixels)
