"""Gemma 4's and Qwen3.5's vision towers in llama.cpp's ``mmproj`` GGUF (``clip.projector_type``
``gemma4v`` and ``qwen3vl_merger``): the HF-shaped config each tower module reads, built from the
file's ``clip.*`` metadata and its tensors' shapes, the file's names as our parameters, and the
converter's layout changes undone (gpu_worker/weights/mmproj.py loads the file through these).

What the file does not say, llama.cpp's runtime fixes and so do we: Gemma 4's vision rope base is
100 and its pooling kernel 3 (unless ``clip.vision.projector.scale_factor`` says), Qwen3.5's rope
base is 10000; both use the tanh GELU. What it says only through shapes is read from them: Gemma 4's
head size (its q norm's length) and key/value heads, the position tables' sizes, the clipped linears'
bounds (present or not), the standardization (``v.std_bias``).

The converter's changes: Gemma 4's patch embedder, a linear over a patch's (row, column, channel)
pixels, is stored as a conv kernel [out, channel, row, column]; its scalar bounds as [1];
Qwen3.5's Conv3d patch embedding is split along its temporal axis into ``v.patch_embd.weight``
and ``v.patch_embd.weight.1``. No norm is stored as ``1 + w`` by either.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import torch

GEMMA4_ROPE_THETA = 100.0
GEMMA4_POOLING = 3
QWEN35_ROPE_THETA = 10000.0
QWEN35_MERGE = 2  # llama.cpp's default when the file names no spatial_merge_size

_BLOCK = re.compile(r"^v\.blk\.(\d+)\.(\w+)\.(weight|bias|input_min|input_max|output_min|output_max)$")
_GEMMA4_LINEARS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}  # fmt: skip
_GEMMA4_NORMS = {
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ln1": "input_layernorm",
    "attn_post_norm": "post_attention_layernorm", "ln2": "pre_feedforward_layernorm",
    "ffn_post_norm": "post_feedforward_layernorm",
}  # fmt: skip
_GEMMA4_NAMES = {
    "v.patch_embd.weight": "vision_tower.patch_embedder.input_proj.weight",
    "v.position_embd.weight": "vision_tower.patch_embedder.position_embedding_table",
    "v.std_bias": "vision_tower.std_bias",
    "v.std_scale": "vision_tower.std_scale",
    "mm.input_projection.weight": "embed_vision.embedding_projection.weight",
}
_QWEN35_BLOCK = {
    "attn_qkv": "attn.qkv", "attn_out": "attn.proj", "ln1": "norm1", "ln2": "norm2",
    "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2",
}  # fmt: skip
_QWEN35_NAMES = {
    "v.patch_embd.weight": "visual.patch_embed.proj.weight",
    "v.patch_embd.weight.1": "visual.patch_embed.proj.weight",  # the second temporal half
    "v.patch_embd.bias": "visual.patch_embed.proj.bias",
    "v.position_embd.weight": "visual.pos_embed.weight",
    "v.post_ln.weight": "visual.merger.norm.weight",
    "v.post_ln.bias": "visual.merger.norm.bias",
    "mm.0.weight": "visual.merger.linear_fc1.weight",
    "mm.0.bias": "visual.merger.linear_fc1.bias",
    "mm.2.weight": "visual.merger.linear_fc2.weight",
    "mm.2.bias": "visual.merger.linear_fc2.bias",
}


def gemma4_name(name: str) -> str | None:
    """Our Gemma4VisionTower parameter for a ``gemma4v`` mmproj tensor (None: one we do not know)."""
    match = _BLOCK.match(name)
    if match is None:
        return _GEMMA4_NAMES.get(name)
    block, part, kind = match.groups()
    prefix = f"vision_tower.encoder.layers.{block}."
    if part in _GEMMA4_LINEARS:
        return prefix + _GEMMA4_LINEARS[part] + (".linear.weight" if kind == "weight" else f".{kind}")
    if part in _GEMMA4_NORMS and kind == "weight":
        return prefix + _GEMMA4_NORMS[part] + ".weight"
    return None


def qwen35_name(name: str) -> str | None:
    """Our Qwen35VisionTower parameter for a ``qwen3vl_merger`` mmproj tensor (None: unknown, such
    as Qwen3-VL's deep-stack mergers, which Qwen3.5 has none of)."""
    match = _BLOCK.match(name)
    if match is None:
        return _QWEN35_NAMES.get(name)
    block, part, kind = match.groups()
    if part not in _QWEN35_BLOCK or kind not in ("weight", "bias"):
        return None
    return f"visual.blocks.{block}.{_QWEN35_BLOCK[part]}.{kind}"


def _vision(fields: dict[str, Any]) -> dict[str, Any]:
    v = "clip.vision."
    return dict(
        hidden_size=int(fields[v + "embedding_length"]),
        intermediate_size=int(fields[v + "feed_forward_length"]),
        patch_size=int(fields[v + "patch_size"]),
    )


def gemma4_config(fields: dict[str, Any], shapes: dict[str, tuple[int, ...]], text: Any) -> SimpleNamespace:
    """The HF-shaped config Gemma4VisionTower reads; ``text``: the language model's config (whether
    an image's tokens attend both ways is its business, not the file's)."""
    head_dim = shapes["v.blk.0.attn_q_norm.weight"][-1]
    vision = SimpleNamespace(
        **_vision(fields),
        num_hidden_layers=int(fields["clip.vision.block_count"]),
        num_attention_heads=int(fields["clip.vision.attention.head_count"]),
        num_key_value_heads=shapes["v.blk.0.attn_k.weight"][0] // head_dim,
        head_dim=head_dim,
        position_embedding_size=shapes["v.position_embd.weight"][1],
        rms_norm_eps=float(fields.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters={"rope_theta": GEMMA4_ROPE_THETA, "rope_type": "axial"},
        pooling_kernel_size=int(fields.get("clip.vision.projector.scale_factor", GEMMA4_POOLING)),
        use_clipped_linears=any(name.endswith(".input_max") for name in shapes),
        standardize="v.std_bias" in shapes,
    )
    text_hidden = shapes["mm.input_projection.weight"][0]
    text = text if text is not None else SimpleNamespace()
    text_config = SimpleNamespace(
        hidden_size=text_hidden,
        use_bidirectional_attention=getattr(text, "use_bidirectional_attention", None),
    )
    return SimpleNamespace(vision_config=vision, get_text_config=lambda: text_config)


def qwen35_config(fields: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> SimpleNamespace:
    """The HF-shaped config Qwen35VisionTower reads."""
    if shapes.get("v.patch_embd.weight") != shapes.get("v.patch_embd.weight.1"):
        raise ValueError("a Qwen3.5 mmproj holds its patch embedding as two temporal halves")
    vision = SimpleNamespace(
        **_vision(fields),
        depth=int(fields["clip.vision.block_count"]),
        num_heads=int(fields["clip.vision.attention.head_count"]),
        out_hidden_size=shapes["mm.2.weight"][0],
        num_position_embeddings=shapes["v.position_embd.weight"][0],
        spatial_merge_size=int(fields.get("clip.vision.spatial_merge_size", QWEN35_MERGE)),
        in_channels=3,
        temporal_patch_size=2,
        hidden_act="gelu_pytorch_tanh",
        rope_parameters={"rope_theta": QWEN35_ROPE_THETA, "rope_type": "axial"},
    )
    return SimpleNamespace(vision_config=vision)


def as_ours(projector: str, name: str, tensor: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
    """The file's ``tensor`` laid out as our parameter ``target`` (None: Qwen's first temporal half,
    which waits for its second)."""
    if projector == "gemma4v" and name == "v.patch_embd.weight":
        out, patch = tensor.shape[0], tensor.shape[-1]
        # [out, channel, row, column] back to the linear's (row, column, channel) inputs
        return tensor.reshape(out, 3, patch, patch).permute(0, 2, 3, 1).reshape(target.shape)
    if projector == "qwen3vl_merger" and name.startswith("v.patch_embd.weight"):
        return None
    return tensor.reshape(target.shape)


def qwen35_patch_embedding(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """The Conv3d kernel [out, channel, 2, patch, patch] from its two temporal halves."""
    return torch.stack((first, second), dim=2)
