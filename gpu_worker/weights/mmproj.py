"""llama.cpp's ``mmproj`` GGUF (``--mmproj PATH``, as llama-server takes it): a vision tower and its
projector in one file, named and laid out as llama.cpp's converter (convert_hf_to_gguf.py --mmproj)
writes them. The tower is built from the file's ``clip.*`` metadata and filled from its tensors
(dequantized to the model's dtype): Gemma 3's (``clip.projector_type`` gemma3) today.

The converter stores Gemma's soft-emb norm as ``1 + w`` (llama.cpp's RMSNorm scales by its weight
alone); our GemmaRMSNorm adds the 1 itself, so it is taken off here.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from gpu_worker.models.vision import VisionTower
from gpu_worker.weights.common import (
    WeightMismatchError,
    check_loaded,
    copy_checked,
    materialize,
    parameters_on_meta,
)

DEFAULT_SCALE_FACTOR = 4  # Gemma 3's pooling kernel, which the converter writes only when it differs
_BLOCK = re.compile(r"^v\.blk\.(\d+)\.(\w+)\.(weight|bias)$")
_BLOCK_PARTS = {
    "ln1": "layer_norm1", "ln2": "layer_norm2", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_out": "self_attn.out_proj",
    "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2",
}  # fmt: skip
_NAMES = {
    "v.patch_embd.weight": "vision_tower.embeddings.patch_embedding.weight",
    "v.patch_embd.bias": "vision_tower.embeddings.patch_embedding.bias",
    "v.position_embd.weight": "vision_tower.embeddings.position_embedding.weight",
    "v.post_ln.weight": "vision_tower.post_layernorm.weight",
    "v.post_ln.bias": "vision_tower.post_layernorm.bias",
    "mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight",
    "mm.soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight",
}


def our_name(name: str) -> str | None:
    """Our parameter for an mmproj tensor (None: one we do not know)."""
    match = _BLOCK.match(name)
    if match is not None and match.group(2) in _BLOCK_PARTS:
        block, part, kind = match.groups()
        return f"vision_tower.encoder.layers.{block}.{_BLOCK_PARTS[part]}.{kind}"
    return _NAMES.get(name)


def mmproj_config(fields: dict[str, Any], text_hidden: int) -> SimpleNamespace:
    """The HF-shaped config Gemma3VisionTower reads, from the file's ``clip.*`` metadata."""
    projector = fields.get("clip.projector_type")
    if projector != "gemma3":
        raise ValueError(f"mmproj projector type {projector!r} is not supported (supported: gemma3)")
    v = "clip.vision."
    vision = SimpleNamespace(
        hidden_size=int(fields[v + "embedding_length"]),
        intermediate_size=int(fields[v + "feed_forward_length"]),
        num_hidden_layers=int(fields[v + "block_count"]),
        num_attention_heads=int(fields[v + "attention.head_count"]),
        image_size=int(fields[v + "image_size"]),
        patch_size=int(fields[v + "patch_size"]),
        num_channels=3,
        layer_norm_eps=float(fields[v + "attention.layer_norm_epsilon"]),
        hidden_act="gelu_pytorch_tanh",
    )
    per_side = (
        vision.image_size
        // vision.patch_size
        // int(fields.get(v + "projector.scale_factor", DEFAULT_SCALE_FACTOR))
    )
    text = SimpleNamespace(hidden_size=text_hidden)
    return SimpleNamespace(
        vision_config=vision, mm_tokens_per_image=per_side**2, get_text_config=lambda: text
    )


def load_mmproj_tower(path: str | Path, dtype: torch.dtype, device: torch.device) -> VisionTower:
    """The vision tower an mmproj file holds, with its weights."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from gpu_worker.models.gemma3_vision import Gemma3VisionTower
    from gpu_worker.weights.loader import _default_dtype

    reader = GGUFReader(str(path))
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {t.name: t for t in reader.tensors}
    if "mm.input_projection.weight" not in tensors:
        raise ValueError(f"{path} has no mm.input_projection.weight: not a Gemma 3 mmproj file")
    text_hidden = int(tensors["mm.input_projection.weight"].data.shape[-1])
    with torch.device(device), _default_dtype(dtype), parameters_on_meta():
        tower = Gemma3VisionTower(mmproj_config(fields, text_hidden))
    materialize(tower, device)
    params = dict(tower.named_parameters())
    unknown = [name for name in tensors if our_name(name) not in params]
    if unknown:
        raise WeightMismatchError(f"{path}: tensors {unknown[:8]} are not in Gemma 3's vision tower")
    with torch.no_grad():
        for name, t in tensors.items():
            target = str(our_name(name))
            values = dequantize(t.data, t.tensor_type).reshape(tuple(params[target].shape))
            tensor = torch.from_numpy(np.array(values, dtype=np.float32))
            if name == "mm.soft_emb_norm.weight":
                tensor = tensor.double() - 1.0  # stored as 1 + w
            copy_checked(params[target], tensor.to(dtype), target)
    check_loaded(tower)
    return tower.eval()  # type: ignore[return-value]
