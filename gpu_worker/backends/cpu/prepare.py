"""The CPU backend's one entry point that readies a loaded model for this CPU: ``prepare_model``.

It works through the layer contract (models/contract.py): it fills the kernel slots each layer
type declares, with ``Layer.attach``, and sets nothing else on a module. On this rank's shard of the
model under tensor parallel (``CpuBackend.prepare_model`` runs it inside
``tensor_parallel.prepare_rank``):
1. The CPU kind (kind.py): RIVULET_CPU_KIND or the CPU's own; it decides everything below.
2. The C kernels built for that kind (kernels.py), where the model's dtype and head shapes fit
   them and they are not turned off (--disable-cpu-kernels).
3. The matmul slots (``impl``): a Linear or embedding the loader gave a GGUF's blocks gets a
   ``QuantLinear`` or ``QuantEmbedding`` (quant.py), stacked experts a ``QuantExperts``, and their
   sparse block a ``QuantRouter`` (experts.py; the runner loads blocks only where the kernels run).
   Every other Linear gets a ``CpuLinear`` (matmul.py): the weight copies its paths read (packed
   for oneDNN, plain bf16 for the C kernel, an fp32 copy) and the path per row count from the
   kind's committed plan; it holds the weight, which the Linear then releases. Not with --compile:
   a compiled graph cannot read oneDNN's opaque blocked tensors.
4. The ``fused`` slots (RMSNorm, rotary, silu * up): the kernels, unless --compile fuses those ops
   itself (a C call would break its graph).
   The Gated DeltaNet layers' ``recurrent_rule``, ``chunked_rule``, ``pooled_rule``, ``pooled_conv``
   and ``decode_step`` slots: the gated delta rule's kernels (gated_delta.py), unless --compile (likewise).
5. Attributes pinned in each module's instance dict (the model's layout is final after this).
6. Where every decoder layer is a kind csrc/decode_layers.c computes (decode_layers.py's positive
   list), a one-call run of all of them for steps whose rows all decode; a dense Qwen3.5's likewise
   by csrc/decode_hybrid.c (decode_hybrid.py, which also fills its gated attention's ``gate_ops``).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Protocol, cast, runtime_checkable

import torch
from torch import nn

from gpu_worker.backends.cpu import decode_hybrid, gated_delta, latent_heads
from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.clamped_experts import experts_impl, router_impl
from gpu_worker.backends.cpu.decode_gemma4 import Gemma4Decode, gemma4_decode
from gpu_worker.backends.cpu.decode_hybrid import HybridDecode, hybrid_decode
from gpu_worker.backends.cpu.decode_layers import FusedDecode
from gpu_worker.backends.cpu.decode_mla import MlaDecode, one_call_decode
from gpu_worker.backends.cpu.experts import interleave_experts, relaid_experts
from gpu_worker.backends.cpu.head_screen import screen_for
from gpu_worker.backends.cpu.hugepages import HugePageArena, arena_bytes
from gpu_worker.backends.cpu.kind import CpuKind, describe, requested_kind
from gpu_worker.backends.cpu.layouts import in_arena, place
from gpu_worker.backends.cpu.malloc import keep_freed_memory
from gpu_worker.backends.cpu.matmul import CpuLinear
from gpu_worker.backends.cpu.quant import QuantEmbedding, QuantLinear, gated
from gpu_worker.models import CausalLM
from gpu_worker.models.contract import Layer, Split
from gpu_worker.models.gated_delta import GatedDeltaNet
from gpu_worker.models.gemma4 import Gemma4ForCausalLM
from gpu_worker.models.layers import Embedding, Linear, MergedLinear
from gpu_worker.models.moe import Experts, SparseMoeBlock
from gpu_worker.models.qwen35 import Qwen35ForCausalLM
from gpu_worker.sampling.head_argmax import GreedyHead
from gpu_worker.weights.formats import QuantBlocks, QuantizedWeight

logger = logging.getLogger(__name__)

_CPU_LINEAR = (torch.float32, torch.bfloat16)


@runtime_checkable
class HoldsTensors(Protocol):
    """A kernel that keeps its own weight copies or layouts (counted in ``weight_bytes``)."""

    def tensors(self) -> list[torch.Tensor]: ...


@dataclass(frozen=True)
class CpuSetup:
    """What ``prepare_model`` chose: the kind, the kernels (None: torch paths), and the one-call
    decode of the decoder layers (None: the modules run every step)."""

    kind: CpuKind
    kernels: cpu_kernels.CpuKernels | None
    decode_layers: FusedDecode | MlaDecode | HybridDecode | Gemma4Decode | None = None


def prepare_model(model: nn.Module, dtype: torch.dtype, use_kernels: bool, compiled: bool) -> CpuSetup:
    """Steps 1-6 of the module docstring, on a model just loaded on the CPU."""
    kind = requested_kind()
    # Block matmuls and small ops wherever the dtype fits; the attention kernel layer by layer where
    # the heads fit it (attention.py), the one-call decode where the model's do (decode_layers.py).
    fits = use_kernels and dtype in cpu_kernels.DTYPE_CODES
    kernels = cpu_kernels.load(kind) if fits else None
    paths: Counter[str] = Counter()
    _attach_quantized(model, dtype, kernels, paths)
    routed = _attach_routers(model, dtype, kernels) if kernels is not None and not compiled else set()
    if not compiled:
        _attach_dense(model, kind, kernels, routed, paths)
    fused = kernels if not compiled else None
    for module in model.modules():
        if isinstance(module, Layer) and "fused" in module.kernel_slots:
            module.attach(fused=fused)
    if kernels is not None and not compiled:
        _attach_delta_rules(model, kernels)
        latent_heads.attach(model, kernels, dtype)
        decode_hybrid.attach(model, kernels)
    pin_attributes(model)
    logger.info(
        "%s; C kernels: %s; matmul paths (Linears): %s; embedding: %s; other weights: %s; "
        "weights held: %.1f MB",
        describe(kind),
        "none" if kernels is None else f"{kind.value} build",
        ", ".join(f"{name} {count}" for name, count in sorted(paths.items())) or "torch",
        _embedding_form(model, dtype),
        str(dtype).removeprefix("torch."),
        weight_bytes(model) / 1e6,
    )
    decode: FusedDecode | MlaDecode | HybridDecode | Gemma4Decode | None = None
    if not compiled and isinstance(model, Qwen35ForCausalLM):  # a hybrid model's (csrc/decode_hybrid.c)
        decode = hybrid_decode(model, kernels, dtype)
    elif not compiled and isinstance(model, Gemma4ForCausalLM):  # runs of its layers (csrc/decode_gemma4.c)
        decode = gemma4_decode(model, kernels, dtype)
    elif not compiled:
        decode = one_call_decode(model, kernels, dtype)
    keep_freed_memory()  # the weights are in place: from here on, steps reuse what they free
    return CpuSetup(kind=kind, kernels=kernels, decode_layers=decode)


def _attach_quantized(
    model: nn.Module, dtype: torch.dtype, kernels: cpu_kernels.CpuKernels | None, paths: Counter[str]
) -> None:
    """QuantLinear / QuantEmbedding for every module the loader gave quantized blocks, first placed in
    the huge-page arena (layouts.py's ``in_arena``): rows interleaved by 8 (csrc/quant_x8.c), 16-bit
    rows copied as they are (a tied head and its embedding share one)."""
    import gguf

    interleaved: dict[int, tuple[QuantizedWeight, QuantizedWeight]] = {}  # id: (as loaded, interleaved)
    head = _screened_head(model)
    arena = HugePageArena(arena_bytes([p.data.numel() for p in _relaid_parts(model)]))
    for module in model.modules():
        if isinstance(module, Experts) and module.quantized is not None:  # experts.py
            assert kernels is not None, "quantized weights are loaded only where the kernels run"
            module.quantized = interleave_experts(module.quantized, arena)
            module.attach(impl=experts_impl(module, kernels, dtype))
            paths["gguf experts"] += 1
            continue
        if not isinstance(module, Linear | Embedding) or module.quantized is None:
            continue
        assert kernels is not None, "quantized weights are loaded only where the kernels run"
        weight = module.quantized
        if id(weight) not in interleaved:
            parts = tuple(
                place(part, arena.take(tuple(part.data.shape))) if in_arena(part) else part
                for part in weight.parts
            )
            interleaved[id(weight)] = (weight, QuantizedWeight(parts))
        weight = module.quantized = interleaved[id(weight)][1]
        types = "+".join(gguf.GGMLQuantizationType(part.type).name for part in weight.parts)
        if isinstance(module, Linear):
            screen = screen_for(weight, module.bias, kernels) if module is head else None
            impl = QuantLinear(weight, module.bias, kernels, screen)
            module.attach(impl=impl)
            halves = (
                isinstance(module, MergedLinear)
                and len(module.sizes) == 2
                and module.sizes[0] == module.sizes[1]
            )
            if halves:  # two equal parts (an MLP's gate and up): silu(gate) * up in one call where it fits
                module.attach(silu_mul=gated(impl))
            if screen is not None:
                held = sum(t.numel() * t.element_size() for t in screen.tensors())
                logger.info("head screen: int8 copy of the %s head, %.1f MB", types.lower(), held / 1e6)
            paths[f"gguf {types}"] += 1
        else:
            module.attach(impl=QuantEmbedding(weight, dtype, kernels))


def _screened_head(model: nn.Module) -> nn.Module | None:
    """The Linear that may get a screen (head_screen.py): the LM head (its rows the vocabulary,
    ``Split.VOCAB``) of a model whose greedy draw its head computes (``GreedyHead``), without a
    final soft-cap (a capped head keeps the full route), on one rank (a vocab-parallel head gathers
    logits: head_argmax.py). No other Linear: none reads a screen, whatever its rows."""
    greedy = isinstance(model, GreedyHead) and not model.head_softcap
    if not greedy or cast("CausalLM", model).tensor_parallel is not None:
        return None
    return next((m for m in model.modules() if isinstance(m, Linear) and m.split is Split.VOCAB), None)


def _attach_dense(
    model: nn.Module,
    kind: CpuKind,
    kernels: cpu_kernels.CpuKernels | None,
    routed: set[int],
    paths: Counter[str],
) -> None:
    """A ``CpuLinear`` for every Linear still without a matmul, which then holds its weight: the
    loaded one is released (a tied embedding keeps its own reference)."""
    for module in model.modules():
        if id(module) in routed:  # its QuantRouter holds the weight: no matmul copy of it
            continue
        if isinstance(module, Linear) and module.impl is None and module.weight.dtype in _CPU_LINEAR:
            impl = CpuLinear(module.weight, module.bias, kind, kernels)
            module.attach(impl=impl)
            module.release_weight()
            paths.update(name for name, has in impl.paths.items() if has)


def _attach_delta_rules(model: nn.Module, kernels: cpu_kernels.CpuKernels) -> None:
    """The gated delta rule's C kernels in each Gated DeltaNet layer whose head dims they take."""
    rules = gated_delta.load(kernels.path)
    for module in model.modules():
        if isinstance(module, GatedDeltaNet) and max(module.d_k, module.d_v) <= gated_delta.MAX_HEAD_DIM:
            module.attach(
                recurrent_rule=gated_delta.HfDeltaRule(rules, chunked=False),
                chunked_rule=gated_delta.HfDeltaRule(rules, chunked=True),
                pooled_rule=rules,  # the rule and the conv1d on the state pool in place, all rows at once
                pooled_conv=rules,
                decode_step=rules,  # a float32 decode step's whole block between its projections
            )


def _relaid_parts(model: nn.Module) -> list[QuantBlocks]:
    """Every block tensor ``_attach_quantized`` places in the arena (once each, a tied head's with its
    embedding's)."""
    seen: dict[int, QuantBlocks] = {}
    for module in model.modules():
        found: list[QuantBlocks] = []
        if isinstance(module, Experts) and module.quantized is not None:
            found = relaid_experts(module.quantized)
        elif isinstance(module, Linear | Embedding) and module.quantized is not None:
            found = [part for part in module.quantized.parts if in_arena(part)]
        seen |= {id(part): part for part in found}
    return list(seen.values())


def _attach_routers(model: nn.Module, dtype: torch.dtype, kernels: cpu_kernels.CpuKernels) -> set[int]:
    """A C router (experts.py's QuantRouter, clamped_experts.py's TopKRouter for gpt-oss) for every
    sparse block whose experts are on blocks (a GGUF's), so the modules route as the one-call decode
    does; returns the ids of the gate Linears it replaces."""
    routed = set()
    for module in model.modules():
        router = router_impl(module, kernels, dtype) if isinstance(module, SparseMoeBlock) else None
        if isinstance(module, SparseMoeBlock) and router is not None:
            module.attach(router=router)
            routed.add(id(module.gate))
    return routed


def _embedding_form(model: nn.Module, dtype: torch.dtype) -> str:
    """How the embedding table is held: a GGUF block type (looked up by the kernels) or the dtype."""
    import gguf

    for module in model.modules():
        if isinstance(module, Embedding):
            weight = module.quantized
            if weight is not None:
                return "gguf " + gguf.GGMLQuantizationType(weight.parts[0].type).name
            return str(dtype).removeprefix("torch.")
    return "none"


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weight tensors the model holds: parameters and every copy a backend's impl
    keeps (each storage counted once: a tied head shares its embedding's)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        held = list(module.parameters(recurse=False))
        if isinstance(module, Linear | Embedding | Experts) and isinstance(module.impl, HoldsTensors):
            held.extend(module.impl.tensors())
        for tensor in held:
            if tensor.device.type == "cpu" and tensor.numel() and not tensor.is_mkldnn:
                storage = tensor.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
            elif tensor.numel():  # oneDNN's blocked tensors have no storage to ask
                seen[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def pin_attributes(model: nn.Module) -> None:
    """Put every module's submodules, parameters and buffers in its instance ``__dict__``.

    nn.Module keeps them in side tables reached through ``__getattr__``, a Python call per
    lookup, far slower than an instance-dict hit; a decode step makes ~30 such lookups per layer,
    a visible share of a one-row step (docs/benchmarks-history.md, "Numbers behind the code's choices").
    Reassigning a submodule or a parameter later stays correct: nn.Module's ``__setattr__`` drops the
    instance-dict entry before it registers the new value. A buffer's it does not (it writes
    ``_buffers`` alone): whatever swaps a buffer does so before the backend prepares the model (as
    ``adopt_media_tokens`` does) or pins again after.
    """
    for module in model.modules():
        for table in (module._modules, module._parameters, module._buffers):
            for name, value in table.items():
                if value is not None:
                    module.__dict__[name] = value
