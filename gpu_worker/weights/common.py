"""What both weight loaders (safetensors and GGUF) share: checkpoint names -> the tensors they fill,
and parameters built without memory, given it only where a weight is to be written.

``load_model`` builds a model under ``parameters_on_meta``: every parameter on the meta device (a
shape, no memory). Each loader then gives real memory (``materialize``) to the parameters it writes;
a weight a GGUF's blocks replace never has any, so a file whose float32 copy would not fit in memory
(or in the address space a ``ulimit -v`` allows) loads in its blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from gpu_worker.models.layers import MergedLinear
from gpu_worker.models.moe import Experts


class WeightMismatchError(ValueError):
    """The checkpoint's weights do not match the model's parameters."""


def weight_targets(
    model: nn.Module, params: dict[str, nn.Parameter], gguf: bool = False
) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the tensor it fills: a parameter, or a row block of a MergedLinear's.

    ``model.layers.0.self_attn.qkv_proj.weight`` is not a checkpoint name; its
    blocks are, as ``model.layers.0.self_attn.q_proj.weight`` and so on. Stacked experts' blocks
    are named per expert: ``model.layers.0.mlp.experts.3.gate_proj.weight`` (``gguf``: as a GGUF's
    tensors fill them, ``Experts.gguf_views``).
    """
    targets: dict[str, torch.Tensor] = dict(params)
    for module_name, module in model.named_modules():
        if isinstance(module, Experts):  # stacked experts: each expert's projections by name
            for param_name, _ in module.named_parameters(recurse=False):
                del targets[f"{module_name}.{param_name}"]
            views = module.gguf_views() if gguf else module.checkpoint_views()
            targets.update({f"{module_name}.{n}": view for n, view in views.items()})
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


class parameters_on_meta(TorchFunctionMode):  # noqa: N801 (used as a context manager, like torch.device)
    """While building a model: ``torch.empty`` without a device makes a meta tensor. Our layers make
    every parameter, and nothing else, with ``torch.empty`` (models/layers.py); buffers (rotary
    tables) are computed by other ops, on the model's device, and stay real."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.empty and kwargs.get("device") is None:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def materialize(model: nn.Module, device: torch.device, skip: Collection[nn.Parameter] = ()) -> None:
    """Unwritten memory on ``device`` for every parameter of ``model`` still on the meta device,
    but those in ``skip`` (the weights a GGUF's blocks replace). A parameter two modules hold (a
    tied head) stays one."""
    skipped = {id(p) for p in skip}
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.is_meta or id(param) in skipped:
                continue
            if id(param) not in made:
                memory = torch.empty(param.shape, dtype=param.dtype, device=device)
                made[id(param)] = nn.Parameter(memory, requires_grad=False)
            setattr(module, name, made[id(param)])


def check_loaded(model: nn.Module) -> None:
    """Every parameter and buffer holds memory once its loader is done (none on the meta device)."""
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not left, f"tensors left on the meta device after loading: {left[:4]}"
