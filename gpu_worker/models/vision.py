"""The vision towers the worker runs, chosen by the HF config's ``model_type``, and their loading
from an HF checkpoint (the tower's tensors only: the language model's are loader.py's).

A tower is ``pixels [B, ...] -> embeddings [B, tokens_per_image, text hidden]``: what takes the
place of an image's run of image tokens (gpu_worker/image_encoder.py puts it there).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from torch import nn

# model_type -> (module under gpu_worker.models, class); tokenizer_proc/images.py lists the same types.
_TOWERS = {
    "gemma3": ("gemma3_vision", "Gemma3VisionTower"),
    "gemma4": ("gemma4_vision", "Gemma4VisionTower"),
    "qwen3_5": ("qwen35_vision", "Qwen35VisionTower"),
}
VISION_MODEL_TYPES = tuple(_TOWERS)


class VisionTower(Protocol):
    tokens_per_image: int

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor: ...


def has_vision_tower(hf_config: Any) -> bool:
    return hf_config.model_type in _TOWERS and getattr(hf_config, "vision_config", None) is not None


def load_vision_tower(model_path: str | Path, dtype: torch.dtype, device: torch.device) -> VisionTower | None:
    """The tower of the HF checkpoint at ``model_path`` with its weights, or None when the model has
    none we run (a text model, a GGUF's language model)."""
    from gpu_worker.weights.common import check_loaded, materialize, parameters_on_meta
    from gpu_worker.weights.loader import _default_dtype, load_hf_config, load_weights, safetensors_files

    hf_config = load_hf_config(model_path)
    if not has_vision_tower(hf_config) or not any(Path(model_path).glob("*.safetensors")):
        return None
    module, name = _TOWERS[hf_config.model_type]
    cls = getattr(importlib.import_module(f"gpu_worker.models.{module}"), name)
    with torch.device(device), _default_dtype(dtype), parameters_on_meta():
        tower: nn.Module = cls(hf_config)
    materialize(tower, device)
    load_weights(tower, safetensors_files(Path(model_path)))
    check_loaded(tower)
    return cast(VisionTower, tower.eval())
