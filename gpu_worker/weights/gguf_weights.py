"""A GGUF file's tensors -> our model's weights, quantized blocks kept as the file holds them
(a backend may then re-lay them: the CPU backend's backends/cpu/layouts.py).

``--weight-dtype auto`` (or ``gguf``) on CPU loads the weights from the GGUF itself, not from
the safetensors its conversion wrote: each Linear (and the embedding, which a tied head shares)
whose tensor is of a type in ``keep`` gets a ``QuantizedWeight`` (the file's block bytes, read
with the ``gguf`` package, never converted), which the CPU backend computes on
(gpu_worker/backends/cpu/quant.py). Tensors of other types are dequantized by ``gguf`` to float32 and
copied into the parameter as the safetensors path would; a log line names their types.

llama.cpp's converter stores the Q and K projections of Llama models with each head's rows
permuted (it pairs rotary dimensions i and i + D/2 as neighbours). Quantization blocks run
along a row (the input dimension), so undoing the permutation by whole output rows keeps every
block intact: the rows end up in HF's order, bit for bit the blocks they were.
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch
from torch import nn

from gpu_worker.models.layers import Embedding, Linear, MergedLinear
from gpu_worker.weights.common import WeightMismatchError, copy_checked, is_tied, weight_targets
from gpu_worker.weights.formats import QuantBlocks, QuantizedWeight, dequantize_blocks

logger = logging.getLogger(__name__)

# Architectures whose GGUF tensor names we map (the model files' HF names are the targets).
ARCHITECTURES = ("llama",)
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_IGNORED = ("rope_freqs.weight",)  # llama3 rope factors: the HF config carries them


class GgufError(ValueError):
    """The GGUF cannot be loaded in quantized form (its architecture, or its tensors)."""


def hf_name(gguf_name: str) -> str | None:
    """The checkpoint (HF) name of a Llama GGUF tensor; None for tensors we do not load."""
    if gguf_name in _IGNORED:
        return None
    match = _LAYER_NAME.match(gguf_name)
    if match:
        layer, tensor, kind = match.groups()
        if tensor not in _LAYER_TENSORS:
            raise GgufError(f"GGUF tensor {gguf_name} has no place in a Llama model")
        return f"model.layers.{layer}.{_LAYER_TENSORS[tensor]}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    if stem not in _GLOBAL_TENSORS:
        raise GgufError(f"GGUF tensor {gguf_name} has no place in a Llama model")
    return f"{_GLOBAL_TENSORS[stem]}.{kind}"


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head rotary permutation of Q/K rows (whole rows move, blocks stay)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor of a GGUF lies: what ``gguf.GGUFReader`` found, kept in the index cache."""

    name: str
    type: int  # ggml type id
    shape: tuple[int, ...]  # ggml order: the innermost (input) dimension first
    offset: int  # bytes from the file's start
    nbytes: int


def tensor_index(path: Path) -> tuple[str, list[TensorEntry]]:
    """(general.architecture, the tensors) of a GGUF. gguf's reader parses every metadata field
    (a tokenizer's 100k strings: seconds on a small CPU), so its findings are cached beside the
    converted model, keyed by the file's path, size and mtime: a warm start reads a small JSON."""
    import json

    from gpu_worker.weights.model_files import cache_root, file_key

    cached = cache_root() / "gguf-index" / f"{path.stem}-{file_key(path)}.json"
    if cached.is_file():
        raw = json.loads(cached.read_text())
        return raw["arch"], [TensorEntry(e[0], e[1], tuple(e[2]), e[3], e[4]) for e in raw["tensors"]]
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    entries = [
        TensorEntry(
            t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), int(t.data_offset), int(t.n_bytes)
        )
        for t in reader.tensors
    ]
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(
        json.dumps(
            {"arch": arch, "tensors": [[e.name, e.type, list(e.shape), e.offset, e.nbytes] for e in entries]}
        )
    )
    os.replace(tmp, cached)
    return arch, entries


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


def read_tensors(
    path: Path, num_heads: int, num_kv_heads: int
) -> Iterator[tuple[str, int, np.ndarray, tuple[int, ...]]]:
    """(HF name, ggml type, data as [rows, row bytes or values] in HF row order, HF shape) of every
    tensor we load, lazily (the file is mapped, not read)."""
    arch, entries = tensor_index(path)
    if arch not in ARCHITECTURES:
        raise GgufError(
            f"GGUF architecture {arch!r} is not one we read quantized ({', '.join(ARCHITECTURES)})"
        )
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    for entry in entries:
        name = hf_name(entry.name)
        if name is None:
            continue
        shape = tuple(reversed(entry.shape))
        data = _tensor_data(mapped, entry)
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            data = unpermute_rows(data, num_heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            data = unpermute_rows(data, num_kv_heads)
        yield name, entry.type, data, shape


def _weight_modules(model: nn.Module) -> dict[str, tuple[nn.Module, str | None]]:
    """HF weight name -> (the Linear or Embedding it fills, its projection in a merged Linear)."""
    out: dict[str, tuple[nn.Module, str | None]] = {}
    for name, module in model.named_modules():
        if isinstance(module, MergedLinear):
            parent = name.rpartition(".")[0]
            for shard in module.shards:
                out[f"{parent}.{shard}.weight" if parent else f"{shard}.weight"] = (module, shard)
        elif isinstance(module, Linear | Embedding):
            out[f"{name}.weight"] = (module, None)
    return out


def load_gguf_weights(model: nn.Module, path: Path, keep: frozenset[int]) -> None:
    """Fill ``model`` from the GGUF at ``path``: tensors of a type in ``keep`` stay quantized (on
    their module's ``quantized``), the rest are dequantized into the parameters. Strict both ways,
    as the safetensors loader is."""
    import gguf

    params = dict(model.named_parameters(remove_duplicate=False))
    tied = {name for name, p in params.items() if is_tied(model, name, p)}
    targets = weight_targets(model, params)
    modules = _weight_modules(model)
    pending: dict[nn.Module, dict[str | None, QuantBlocks]] = defaultdict(dict)
    loaded: set[str] = set()
    dequantized: Counter[str] = Counter()
    unexpected: list[str] = []
    num_heads, num_kv_heads = int(model.num_heads), int(model.num_kv_heads)  # type: ignore[arg-type]
    with torch.no_grad():
        for name, ggml_type, data, shape in read_tensors(path, num_heads, num_kv_heads):
            if name in tied:
                continue
            if name not in targets:
                unexpected.append(name)
                continue
            if ggml_type in keep and name in modules:
                module, shard = modules[name]
                pending[module][shard] = QuantBlocks(ggml_type, torch.from_numpy(np.array(data)), shape[-1])
            else:
                if ggml_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                    dequantized[_type_name(ggml_type)] += 1
                copy_checked(targets[name], dequantize_blocks(ggml_type, data, shape), name)
            loaded.add(name)
        missing = sorted(set(targets) - loaded - tied)
        if missing or unexpected:
            raise WeightMismatchError(f"missing weights {missing[:8]}, unexpected weights {unexpected[:8]}")
        shared = _shared_weights(model)
        for module, blocks in pending.items():
            _attach(module, blocks, dequantized)
            for other in shared.get(id(module), ()):  # a tied head reads the embedding's blocks
                other.quantized, other.weight = module.quantized, module.weight
    if dequantized:
        logger.info(
            "GGUF tensors without a quantized kernel, dequantized at load: %s",
            ", ".join(f"{count} {name}" for name, count in sorted(dequantized.items())),
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
    order: list[str | None] = list(module.shards) if isinstance(module, MergedLinear) else [None]
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
    weight = QuantizedWeight(tuple(parts))
    dtype = cast(torch.Tensor, module.weight).dtype
    module.quantized = weight  # type: ignore[assignment]
    # The parameter was never written (torch.empty): an empty one frees its address space.
    module.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
