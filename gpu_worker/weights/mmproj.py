"""llama.cpp's ``mmproj`` GGUF (``--mmproj PATH``, as llama-server takes it): a vision tower and its
projector in one file, named and laid out as llama.cpp's converter (convert_hf_to_gguf.py --mmproj)
writes them. The tower is built from the file's ``clip.*`` metadata and filled from its tensors
(dequantized to the model's dtype): Gemma 3's (``clip.projector_type`` gemma3) here, Gemma 4's
(``gemma4v``) and Qwen3.5's (``qwen3vl_merger``) through mmproj_towers.py.

The converter stores Gemma's soft-emb norm as ``1 + w`` (llama.cpp's RMSNorm scales by its weight
alone); our GemmaRMSNorm adds the 1 itself, so it is taken off here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
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


SUPPORTED = ("gemma3", "gemma4v", "qwen3vl_merger")  # clip.projector_type values


def _tower_of(
    projector: Any, fields: dict[str, Any], shapes: dict[str, tuple[int, ...]], model_config: Any
) -> tuple[torch.nn.Module, Callable[[str], str | None]]:
    """The tower module (on the current default device and dtype) and its name map."""
    from gpu_worker.models.gemma3_vision import Gemma3VisionTower
    from gpu_worker.models.gemma4_vision import Gemma4VisionTower
    from gpu_worker.models.qwen35_vision import Qwen35VisionTower
    from gpu_worker.weights import mmproj_towers as towers

    if projector == "gemma4v":
        text = model_config.get_text_config() if model_config is not None else None
        return Gemma4VisionTower(towers.gemma4_config(fields, shapes, text)), towers.gemma4_name
    if projector == "qwen3vl_merger":
        return Qwen35VisionTower(towers.qwen35_config(fields, shapes)), towers.qwen35_name
    if "mm.input_projection.weight" not in shapes:
        raise ValueError("no mm.input_projection.weight: not a Gemma 3 mmproj file")
    text_hidden = shapes["mm.input_projection.weight"][-1]
    return Gemma3VisionTower(mmproj_config(fields, text_hidden)), our_name


def load_mmproj_tower(
    path: str | Path, dtype: torch.dtype, device: torch.device, model_config: Any = None
) -> VisionTower:
    """The vision tower an mmproj file holds, with its weights; ``model_config``: the language
    model's HF config (Gemma 4's text config says whether image tokens attend both ways)."""
    from gguf import GGUFReader

    from gpu_worker.weights.loader import _default_dtype
    from gpu_worker.weights.mmproj_towers import as_ours, qwen35_patch_embedding

    reader = GGUFReader(str(path))
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {t.name: t for t in reader.tensors}
    shapes = {name: tuple(int(n) for n in t.data.shape) for name, t in tensors.items()}
    # A converter that may also write an audio tower names the vision projector under clip.vision.
    projector = fields.get("clip.projector_type") or fields.get("clip.vision.projector_type")
    if projector not in SUPPORTED:
        raise ValueError(
            f"mmproj projector type {projector!r} is not supported (supported: {', '.join(SUPPORTED)})"
        )
    with torch.device(device), _default_dtype(dtype), parameters_on_meta():
        tower, name_of = _tower_of(projector, fields, shapes, model_config)
    materialize(tower, device)
    params = dict(tower.named_parameters())
    unknown = [name for name in tensors if name_of(name) not in params]
    if unknown:
        raise WeightMismatchError(f"{path}: tensors {unknown[:8]} are not in the {projector} vision tower")
    with torch.no_grad():
        for name in tensors:
            target = str(name_of(name))
            tensor = _values(tensors[name])
            if name == "mm.soft_emb_norm.weight":
                tensor = tensor.double() - 1.0  # Gemma 3's, stored as 1 + w
            if name == "v.patch_embd.weight.1":  # Qwen's second temporal half: the kernel is whole
                first = _values(tensors["v.patch_embd.weight"]).reshape(tensor.shape)
                tensor = qwen35_patch_embedding(first, tensor)
            elif (laid := as_ours(str(projector), name, tensor, params[target])) is not None:
                tensor = laid
            else:
                continue
            copy_checked(params[target], tensor.reshape(params[target].shape).to(dtype), target)
    check_loaded(tower)
    return tower.eval()  # type: ignore[return-value]


def _values(tensor: Any) -> torch.Tensor:
    """A file tensor's values in float32, shaped as the file's numpy shape."""
    from gguf.quants import dequantize

    values = dequantize(tensor.data, tensor.tensor_type).reshape(tuple(int(n) for n in tensor.data.shape))
    return torch.from_numpy(np.array(values, dtype=np.float32))
