"""HF directory (config.json + *.safetensors) -> one of our models, weights checked by name.

Our modules name their parameters as the checkpoint does, so loading is a
one-for-one copy: a weight the checkpoint lacks, a weight we do not know, or a
shape mismatch is an error. Tied embeddings share one tensor and the
checkpoint may omit ``lm_head.weight``. A merged projection (``qkv_proj``)
is filled block by block from the checkpoint's separate ones (``q_proj`` ...),
each of which must be present exactly as a plain weight would. A weight the
checkpoint holds [in, out] (GPT-2's Conv1D: the model's ``checkpoint_transposed``)
is transposed into its [out, in] Linear.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import torch
from safetensors import safe_open
from torch import nn

from gpu_worker.models import CausalLM, model_class
from gpu_worker.models.moe import Experts
from gpu_worker.weights.common import (
    WeightMismatchError,
    check_loaded,
    copy_checked,
    is_tied,
    materialize,
    parameters_on_meta,
    weight_targets,
)
from gpu_worker.weights.gguf_weights import load_gguf_weights
from gpu_worker.weights.model_files import gguf_of
from gpu_worker.weights.mxfp4 import PACKED, hold_mxfp4_experts, kept_experts, unpack_mxfp4

# Buffers some checkpoints carry that are not weights (causal masks, rotary tables).
_IGNORED = re.compile(r"(\.attn\.(bias|masked_bias)|\.rotary_emb\.inv_freq)$")


def load_hf_config(model_path: str | Path) -> Any:
    """The model's HF config: transformers' class for it, or for a GGUF's metadata directory whose
    rope needs none of transformers' tables, the config.json gguf_config.py wrote, as attributes
    (``GgufConfig``: every field the model files read is written there; importing transformers'
    config classes is a large share of a start's CPU time: docs/benchmarks-history.md)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    if gguf_of(model_path) is not None and _default_rope(config.get("rope_parameters") or {}):
        return GgufConfig(**config)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_path))


class GgufConfig(SimpleNamespace):
    """A GGUF's config.json as attributes, nothing defaulted (see ``load_hf_config``)."""

    def get_text_config(self) -> GgufConfig:
        return self


def _default_rope(params: dict[str, Any]) -> bool:
    """Plain rope frequencies (or Llama 3's factors, which rope.py applies itself), per layer type
    where layers differ."""
    per_type = [p for p in params.values() if isinstance(p, dict)]
    return all(p.get("rope_type", "default") == "default" for p in per_type or [params])


def load_model(
    model_path: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    gguf: Path | None = None,
    keep: frozenset[int] = frozenset(),
) -> tuple[CausalLM, Any]:
    """Build our model for ``model_path`` on ``device`` in ``dtype`` and fill every weight: from
    the checkpoint's safetensors, or with ``gguf`` (by default the GGUF whose metadata directory
    ``model_path`` is: model_files.py), from that file, blocks of the ggml types in ``keep`` left
    quantized and the rest dequantized tensor by tensor (gguf_weights.py). Returns the model and
    its (text model's) HF config.

    The model is built with its parameters on the meta device (common.py): a weight kept in blocks
    is never allocated, the others are as their loader fills them."""
    gguf = gguf if gguf is not None else gguf_of(model_path)
    hf_config = load_hf_config(model_path)
    cls = model_class(hf_config.model_type)
    with torch.device(device), _default_dtype(dtype), parameters_on_meta():
        model = cls(hf_config)
    if gguf is None:
        files = safetensors_files(Path(model_path))
        held = kept_experts(model, checkpoint_keys(files), keep)
        materialize(model, device, skip=[p for m in held.values() for p in (m.gate_up_proj, m.down_proj)])
        load_weights(model, files, held)
    else:
        load_gguf_weights(model, gguf, keep, device)
    check_loaded(model)
    return cast(CausalLM, model.eval()), hf_config.get_text_config()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Our layers allocate with torch.empty in the default dtype; set it only while building."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files: those the shard index names, else every *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / name for name in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


def checkpoint_keys(files: list[Path]) -> set[str]:
    """The names of every tensor the checkpoint's files hold (their headers alone are read)."""
    keys: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys.update(f.keys())
    return keys


def load_weights(model: nn.Module, files: list[Path], held: dict[str, Experts] | None = None) -> None:
    """Copy every checkpoint tensor into the parameter (or merged row block) it names; strict both ways.
    ``held``: experts (by module name) that keep their checkpoint's MXFP4 blocks (mxfp4.py)."""
    held = held or {}
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = {name for name, p in params.items() if is_tied(model, name, p)}
    targets = weight_targets(model, params)
    transposed = re.compile(getattr(model, "checkpoint_transposed", "(?!)"))  # "(?!)": none
    loaded: set[str] = set()
    unexpected: list[str] = []
    packed: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)  # MXFP4 tensors' blocks and scales
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if (mxfp4 := PACKED.match(key)) is not None:
                        packed[mxfp4.group(1)][mxfp4.group(2)] = f.get_tensor(key)
                        continue
                    name = checkpoint_name(model, key, targets)
                    if name is None or _IGNORED.search(name) or name in tied:
                        continue  # a tied head saved anyway is the embedding again
                    if name not in targets:
                        unexpected.append(key)
                        continue
                    tensor = f.get_tensor(key)
                    copy_checked(targets[name], tensor.t() if transposed.search(name) else tensor, name)
                    loaded.add(name)
        for prefix, module in held.items():  # blocks kept as blocks
            parts = {proj: packed.pop(f"{prefix}.{proj}") for proj in ("gate_up_proj", "down_proj")}
            hold_mxfp4_experts(module, parts)
            loaded.update(f"{prefix}.{proj}" for proj in parts)
        for key, values in unpack_mxfp4(packed):
            name = checkpoint_name(model, key, targets)
            if name is None or name not in targets:
                unexpected.append(f"{key}_blocks")
                continue
            # As transformers loads them: stacked experts' blocks [E, rows, k] are its [E, k, rows].
            copy_checked(targets[name], values.transpose(-1, -2) if values.dim() == 3 else values, name)
            loaded.add(name)
    missing = sorted(set(targets) - loaded - tied)
    if missing or unexpected:
        raise WeightMismatchError(f"missing weights {missing[:8]}, unexpected weights {unexpected[:8]}")


def checkpoint_name(model: nn.Module, key: str, targets: dict[str, torch.Tensor]) -> str | None:
    """Our name for checkpoint tensor ``key``; None for tensors the model does not serve.

    A model may say how its checkpoints spell names: ``checkpoint_prefix`` (GPT-2's original files
    omit ``transformer.``), ``checkpoint_renames`` (regex, replacement) pairs (the text model of a
    multimodal Gemma 3 under ``language_model.``), ``checkpoint_skipped`` (its vision tower)."""
    skipped = getattr(model, "checkpoint_skipped", None)
    if skipped is not None and re.match(skipped, key):
        return None
    for pattern, replacement in getattr(model, "checkpoint_renames", ()):
        key = re.sub(pattern, replacement, key)
    prefix = getattr(model, "checkpoint_prefix", "")
    return key if key in targets or not prefix or key.startswith(prefix) else prefix + key


def round_weights(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Round every parameter through ``dtype`` in place (--weight-dtype bfloat16 under a wider --dtype)."""
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                param.copy_(param.to(dtype))
