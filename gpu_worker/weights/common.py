"""What both weight loaders (safetensors and GGUF) share: checkpoint names -> the tensors they fill."""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.models.layers import MergedLinear
from gpu_worker.models.moe import Experts


class WeightMismatchError(ValueError):
    """The checkpoint's weights do not match the model's parameters."""


def weight_targets(model: nn.Module, params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the tensor it fills: a parameter, or a row block of a MergedLinear's.

    ``model.layers.0.self_attn.qkv_proj.weight`` is not a checkpoint name; its
    blocks are, as ``model.layers.0.self_attn.q_proj.weight`` and so on. Stacked experts' blocks
    are named per expert: ``model.layers.0.mlp.experts.3.gate_proj.weight``.
    """
    targets: dict[str, torch.Tensor] = dict(params)
    for module_name, module in model.named_modules():
        if isinstance(module, Experts):  # stacked experts: each expert's projections by name
            for param_name, _ in module.named_parameters(recurse=False):
                del targets[f"{module_name}.{param_name}"]
            targets.update({f"{module_name}.{n}": view for n, view in module.checkpoint_views().items()})
            continue
        if not isinstance(module, MergedLinear) or module.fused_checkpoint:
            continue  # (Phi-3's checkpoint holds qkv_proj and gate_up_proj as one tensor each)
        parent = module_name.rpartition(".")[0]
        for param_name, param in module.named_parameters(recurse=False):
            del targets[f"{module_name}.{param_name}"]
            for shard, (start, rows) in module.shards.items():
                shard_name = f"{parent}.{shard}.{param_name}" if parent else f"{shard}.{param_name}"
                targets[shard_name] = param.narrow(0, start, rows)
    return targets


def is_tied(model: nn.Module, name: str, param: torch.Tensor) -> bool:
    """A head whose tensor is the input embedding's (the checkpoint may omit it)."""
    if not name.startswith("lm_head."):
        return False
    return any(p is param for n, p in model.named_parameters(remove_duplicate=False) if n != name)


def copy_checked(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise WeightMismatchError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
    param.copy_(tensor)
