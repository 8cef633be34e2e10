"""A GGUF file's tensors -> our model's weights, quantized blocks kept as the file holds them
(a backend may then re-lay them: the CPU backend's backends/cpu/layouts.py).

Every GGUF loads from the file itself, never from a converted copy. Each Linear (and the embedding,
which a tied head shares) whose tensor is of a type in ``keep`` gets a ``QuantizedWeight`` (the
file's block bytes, mapped, not copied: llama.cpp's mmap), which the CPU backend computes on
(gpu_worker/backends/cpu/quant.py). Tensors of other types, and every tensor where ``keep`` is empty
(TP before its split, --weight-dtype bfloat16/float32, --compile, other devices), are dequantized
by ``gguf`` one at a time into their parameter: the float32 copy of the whole model never exists.
The model is built with its parameters on the meta device (common.py): the weights the blocks replace
are never allocated, the others get their memory just before they are filled.

How llama.cpp's converter names and changes each architecture's tensors, and how that is undone:
gguf_names.py.
A mixture of experts' file (Qwen3-MoE's ``qwen3moe``; Mixtral's, of llama's architecture) stacks each
expert projection into one tensor [experts, rows, cols] (``ffn_gate_exps`` ...): kept, its blocks stay
as they lie (``QuantizedExperts``), else each expert's block is filled from its dequantized values.
"""

from __future__ import annotations

import logging
import re
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import numpy as np
import torch
from torch import nn

from gpu_worker.models.layers import Embedding, Linear, MergedLinear
from gpu_worker.models.moe import Experts
from gpu_worker.weights.common import WeightMismatchError, copy_checked, is_tied, materialize, weight_targets
from gpu_worker.weights.formats import (
    SIXTEEN_BIT_GROUP,
    SIXTEEN_BIT_TYPES,
    QuantBlocks,
    QuantizedExperts,
    QuantizedWeight,
    dequantize_blocks,
)
from gpu_worker.weights.gguf_file import GgufHeader, TensorEntry, read_header
from gpu_worker.weights.gguf_gemma4 import split_gate_up
from gpu_worker.weights.gguf_hybrid import HYBRID_ARCHITECTURES, hybrid_tensor
from gpu_worker.weights.gguf_mla import hold_heads, joined_kv_b
from gpu_worker.weights.gguf_names import (
    ARCHITECTURES,
    LAYER_TENSORS,
    NORMS_PLUS_ONE,
    PERMUTED_QK,
    STACKED,
    GgufError,
    hf_name,
    unpermute_rows,
)

logger = logging.getLogger(__name__)


def _tensor_data(mapped: np.ndarray, entry: TensorEntry) -> np.ndarray:
    """The tensor's bytes as gguf's reader gives them: float32/float16 values, else [rows, row bytes]."""
    import gguf

    raw = mapped[entry.offset : entry.offset + entry.nbytes]
    rows = int(np.prod(entry.shape[1:], dtype=np.int64))
    if entry.type == gguf.GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(rows, -1)
    if entry.type == gguf.GGMLQuantizationType.F16:
        return raw.view(np.float16).reshape(rows, -1)
    return raw.reshape(rows, -1)


def _architecture(header: GgufHeader) -> str:
    arch = header.architecture
    if arch not in LAYER_TENSORS:
        raise GgufError(f"GGUF architecture {arch!r} is not one we read ({', '.join(ARCHITECTURES)})")
    return arch


def read_tensors(
    header: GgufHeader, num_heads: int, num_kv_heads: int
) -> Iterator[tuple[str, int, np.ndarray, tuple[int, ...]]]:
    """(HF name, ggml type, data as [rows, row bytes or values] in HF row order, HF shape) of every
    tensor we load, lazily (the file is mapped, not read)."""
    path, arch = header.path, _architecture(header)
    # Copy-on-write: blocks kept as they lie are views of the file's pages (read as first used,
    # shared with the page cache, never copied); nothing writes to them.
    mapped = np.memmap(path, dtype=np.uint8, mode="c")
    for entry in header.tensors:
        name = hf_name(entry.name, arch)
        if name is None:
            continue
        shape = tuple(reversed(entry.shape))
        data = _tensor_data(mapped, entry)
        if arch in PERMUTED_QK and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = unpermute_rows(data, num_heads)
        elif arch in PERMUTED_QK and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = unpermute_rows(data, num_kv_heads)
        elif arch in NORMS_PLUS_ONE and "norm." in name:  # HF's parameter is w; the file holds 1 + w
            data = data.astype(np.float32) - np.float32(1.0)
        elif arch in HYBRID_ARCHITECTURES:
            data, shape = hybrid_tensor(name, data, shape)
        yield name, entry.type, data, shape


def _weight_modules(model: nn.Module) -> dict[str, tuple[nn.Module, str | None]]:
    """HF weight name -> (the Linear or Embedding it fills, its projection in a merged Linear)."""
    out: dict[str, tuple[nn.Module, str | None]] = {}
    for name, module in model.named_modules():
        if isinstance(module, MergedLinear) and not module.fused_checkpoint:
            parent = name.rpartition(".")[0]
            for shard in module.shards:
                out[f"{parent}.{shard}.weight" if parent else f"{shard}.weight"] = (module, shard)
        elif isinstance(module, Linear | Embedding):
            out[f"{name}.weight"] = (module, None)
    return out


def load_gguf_weights(model: nn.Module, path: Path, keep: frozenset[int], device: torch.device) -> None:
    """Fill ``model`` from the GGUF at ``path``: tensors of a type in ``keep`` stay quantized (on
    their module's ``quantized``), the rest are dequantized into the parameters, which get their
    memory on ``device`` here (built on the meta device: common.py). Strict both ways, as the
    safetensors loader is."""
    import gguf

    header = read_header(path)
    modules = _weight_modules(model)
    experts = {name: m for name, m in model.named_modules() if isinstance(m, Experts)}
    materialize(model, device, skip=_kept_in_blocks(header, keep, modules, experts))
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = {name for name, p in params.items() if is_tied(model, name, p)}
    targets = weight_targets(model, params, gguf=True)
    pending: dict[nn.Module, dict[str | None, QuantBlocks]] = defaultdict(dict)
    loaded: set[str] = set()
    dequantized: Counter[str] = Counter()
    unexpected: list[str] = []
    num_heads, num_kv_heads = int(model.num_heads), int(model.num_kv_heads)  # type: ignore[arg-type]
    layers = int(model.num_layers)  # type: ignore[arg-type]
    with torch.no_grad():
        heads: dict[str, tuple[QuantBlocks, QuantBlocks]] = {}  # latent attention's k_b / v_b blocks
        tensors = split_gate_up(joined_kv_b(read_tensors(header, num_heads, num_kv_heads), layers, heads))
        for name, ggml_type, data, shape in tensors:
            if name in tied:
                continue
            stacked = STACKED.match(name)
            if stacked is not None and stacked.group(1) in experts:
                entry = (ggml_type, data, shape)
                loaded.update(_load_stacked(experts, stacked, entry, targets, keep, pending, dequantized))
                continue
            if name not in targets:
                unexpected.append(name)
                continue
            if held_as_blocks(ggml_type, shape[-1], keep) and name in modules:
                module, shard = modules[name]
                pending[module][shard] = QuantBlocks(
                    ggml_type, torch.from_numpy(data.view(np.uint8)), shape[-1]
                )
            else:
                if ggml_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                    dequantized[_type_name(ggml_type)] += 1
                copy_checked(targets[name], dequantize_blocks(ggml_type, data, shape), name)
            loaded.add(name)
        missing = sorted(set(targets) - loaded - tied)
        if missing or unexpected:
            raise WeightMismatchError(f"missing weights {missing[:8]}, unexpected weights {unexpected[:8]}")
        hold_heads(model, heads, lambda part: held_as_blocks(part.type, part.cols, keep))
        shared = _shared_weights(model)
        for module, kept in pending.items():
            if isinstance(module, Experts):
                _attach_experts(module, kept, dequantized)
                continue
            _attach(module, kept, dequantized)
            for other in shared.get(id(module), ()):  # a tied head reads the embedding's blocks
                other.quantized, other.weight = module.quantized, module.weight
    if dequantized:
        logger.info(
            "GGUF tensors without a quantized kernel, dequantized at load: %s",
            ", ".join(f"{count} {name}" for name, count in sorted(dequantized.items())),
        )


def held_as_blocks(ggml_type: int, cols: int, keep: frozenset[int]) -> bool:
    """Whether a tensor of ``ggml_type`` with rows of ``cols`` stays in its file's bytes: a 16-bit
    float one where its rows are whole groups (formats.py; llama.cpp's quantizer writes F16 for rows
    it cannot block at all, which are then widened at load)."""
    return ggml_type in keep and (ggml_type not in SIXTEEN_BIT_TYPES or cols % SIXTEEN_BIT_GROUP == 0)


def _kept_in_blocks(
    header: GgufHeader,
    keep: frozenset[int],
    modules: dict[str, tuple[nn.Module, str | None]],
    experts: dict[str, Experts],
) -> list[nn.Parameter]:
    """The parameters the file's blocks will replace, never to be allocated: the weight of each
    Linear or embedding whose every tensor (each part of a merged one) is of a type in ``keep``,
    and the stacked pair of each Experts whose three projections are (else ``_attach`` and
    ``_attach_experts`` dequantize into the parameter)."""
    arch = _architecture(header)
    held = {hf_name(e.name, arch) for e in header.tensors if held_as_blocks(e.type, e.shape[0], keep)}
    names: dict[nn.Module, list[str]] = defaultdict(list)
    for name, (module, _) in modules.items():
        names[module].append(name)
    blocks = [cast(nn.Parameter, m.weight) for m, ns in names.items() if all(n in held for n in ns)]
    for prefix, module in experts.items():
        stacked = [f"{prefix}.{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj")]
        if all(name in held for name in stacked):
            blocks += [module.gate_up_proj, module.down_proj]
    return blocks


def _load_stacked(
    experts: dict[str, Experts],
    stacked: re.Match[str],
    entry: tuple[int, np.ndarray, tuple[int, ...]],
    targets: dict[str, torch.Tensor],
    keep: frozenset[int],
    pending: dict[nn.Module, dict[str | None, QuantBlocks]],
    dequantized: Counter[str],
) -> list[str]:
    """A stacked expert tensor ([experts, rows, cols]): its blocks as the file holds them (every
    expert's rows in turn) into ``pending`` where its type is kept, else dequantized into each
    expert's block. Returns the per-expert names it filled."""
    prefix, proj = stacked.groups()
    module, (ggml_type, data, shape) = experts[prefix], entry
    names = [f"{prefix}.{e}.{proj}.weight" for e in range(module.num_experts)]
    want = (module.num_experts, *targets[names[0]].shape)
    if tuple(shape) != want:
        raise WeightMismatchError(f"{prefix}.{proj}: GGUF shape {tuple(shape)} != {want}")
    if held_as_blocks(ggml_type, shape[-1], keep):
        pending[module][proj] = QuantBlocks(ggml_type, torch.from_numpy(data.view(np.uint8)), shape[-1])
        return names
    if ggml_type not in (0, 1):  # F32, F16
        dequantized[_type_name(ggml_type)] += 1
    values = dequantize_blocks(ggml_type, data, shape)
    for e, name in enumerate(names):
        targets[name].copy_(values[e])
    return names


def _attach_experts(
    module: Experts, blocks: dict[str | None, QuantBlocks], dequantized: Counter[str]
) -> None:
    """Give ``module`` its stacked blocks, or (a projection of a type without kernels beside them)
    dequantize the kept projections into its parameters instead."""
    if set(blocks) != {"gate_proj", "up_proj", "down_proj"}:
        views = module.gguf_views()
        for proj, part in blocks.items():
            dequantized[f"{_type_name(part.type)} (beside a dense projection)"] += 1
            values = part.dequantize().view(module.num_experts, -1, part.cols)
            for e in range(module.num_experts):
                views[f"{e}.{proj}.weight"].copy_(values[e])
        return
    module.hold_blocks(
        QuantizedExperts(blocks["gate_proj"], blocks["up_proj"], blocks["down_proj"], module.num_experts)
    )


def _type_name(ggml_type: int) -> str:
    import gguf

    return gguf.GGMLQuantizationType(ggml_type).name


def _shared_weights(model: nn.Module) -> dict[int, list[nn.Module]]:
    """id(module) -> the other Linears/Embeddings holding the same weight tensor (tied heads)."""
    holders: dict[int, list[nn.Module]] = defaultdict(list)
    for module in model.modules():
        if isinstance(module, Linear | Embedding):
            holders[id(module.weight)].append(module)
    return {
        id(m): [o for o in group if o is not m] for group in holders.values() for m in group if len(group) > 1
    }


def _attach(module: nn.Module, blocks: dict[str | None, QuantBlocks], dequantized: Counter[str]) -> None:
    """Give ``module`` its quantized weight, or (a merged Linear with a projection of another,
    dense type) dequantize the quantized projections into its parameter instead."""
    order: list[str | None] = [None]
    if isinstance(module, MergedLinear) and not module.fused_checkpoint:
        order = list(module.shards)
    if any(shard not in blocks for shard in order):
        for shard, part in blocks.items():
            dequantized[f"{_type_name(part.type)} (beside a dense projection)"] += 1
            assert isinstance(module, MergedLinear) and shard is not None
            start, rows = module.shards[shard]
            module.weight.narrow(0, start, rows).copy_(part.dequantize())
        return
    parts = [blocks[shard] for shard in order]
    if all(part.type == parts[0].type for part in parts):  # one matmul over the merged rows
        parts = [QuantBlocks(parts[0].type, torch.cat([p.data for p in parts]), parts[0].cols)]
    assert isinstance(module, Linear | Embedding)
    module.hold_blocks(QuantizedWeight(tuple(parts)))
