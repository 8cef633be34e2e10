"""The CPU backend (``CpuBackend``) and the one entry point that readies a loaded model for this
CPU: ``prepare_model``.

Its steps, in this order (each depends on the one before), on this rank's shard of the model under
tensor parallel (``CpuBackend.prepare_model`` runs them inside ``tensor_parallel.prepare_rank``):
1. The CPU kind (kind.py): RIVULET_CPU_KIND or the CPU's own; it decides everything below.
2. The C kernels built for that kind (kernels.py), where the model's dtype and head shapes fit
   them and they are not turned off (--disable-cpu-kernels).
3. Every ``Linear`` gets a ``CpuLinear`` (matmul.py): the weight copies its paths read (packed for
   oneDNN, plain bf16 for the C kernel, an fp32 copy) and the path per row count from the kind's
   committed plan. The loaded weight is then dropped from the module; the CpuLinear owns it.
   Not with --compile: a compiled graph cannot read oneDNN's opaque blocked tensors.
   A Linear or embedding the loader gave a GGUF's quantized blocks gets a ``QuantLinear`` or
   ``QuantEmbedding`` (quant.py) instead; the runner loads blocks only where the kernels run.
4. Modules with a ``fused`` attribute (RMSNorm, rotary, silu * up) get the kernels, unless --compile
   fuses those ops itself (a C call would break its graph).
5. Attributes pinned in each module's instance dict (the model's layout is final after this).
6. Where the model fits it (decode_layers.py: a Llama whose every layer Linear holds GGUF blocks),
   a one-call run of all its decoder layers for steps whose rows all decode.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gpu_worker import tensor_parallel
from gpu_worker.backends.base import ALL_REDUCE
from gpu_worker.backends.cpu import attention as cpu_attention
from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.decode_layers import FusedDecode, fused_decode
from gpu_worker.backends.cpu.experts import QuantExperts, QuantRouter, interleave_experts, relaid_experts
from gpu_worker.backends.cpu.hugepages import HugePageArena, arena_bytes
from gpu_worker.backends.cpu.kind import CpuKind, describe, requested_kind
from gpu_worker.backends.cpu.layouts import interleave_rows, interleaves
from gpu_worker.backends.cpu.malloc import keep_freed_memory
from gpu_worker.backends.cpu.matmul import PLANS, CpuLinear
from gpu_worker.backends.cpu.quant import QuantEmbedding, QuantLinear
from gpu_worker.backends.cpu.threads import ContentionGuard, ThreadTuner, shape_class
from gpu_worker.backends.memory import kv_pool_tokens
from gpu_worker.backends.torch import attention as torch_attention
from gpu_worker.models.layers import Embedding, Linear
from gpu_worker.models.moe import Experts, SparseMoeBlock

if TYPE_CHECKING:
    from gpu_worker.config import WorkerConfig
    from gpu_worker.forward_context import AttentionOptions, ForwardContext
    from gpu_worker.kv_cache import KVPool
    from gpu_worker.tensor_parallel import TensorParallel
from gpu_worker.weights.formats import QuantBlocks, QuantizedExperts, QuantizedWeight

logger = logging.getLogger(__name__)


_CPU_LINEAR = (torch.float32, torch.bfloat16)
# ggml type ids with kernels in csrc/quant*.c (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), where built.
QUANT_TYPES = (2, 3, 8, 12, 13, 14)
# --kv-cache-dtype auto under float32 activations, where the C kernels attend: half the bytes a
# decode step reads per position (at 2048 positions one stream's KV outweighs the embedded model's
# weights). float16 over bfloat16: 3 more mantissa bits, and the kernels widen either in one
# instruction. On the embedded model's exactness prompts, teacher-forced, float16 KV moves the
# logits by at most 0.018 from float32 KV's, bfloat16 by up to 0.18, more than the 0.08 by which
# its first answer token to "What is the capital of France?" leads. (llama.cpp's default is f16 too.)
KV_AUTO_16BIT = torch.float16


@dataclass(frozen=True)
class CpuSetup:
    """What ``prepare_model`` chose: the kind, the kernels (None: torch paths), and the one-call
    decode of the decoder layers (None: the modules run every step)."""

    kind: CpuKind
    kernels: cpu_kernels.CpuKernels | None
    decode_layers: FusedDecode | None = None


def auto_dtype(kind: CpuKind | None = None, gguf_blocks: bool = False) -> str:
    """``--dtype auto`` on CPU: bfloat16 where a bf16 matmul path beats fp32 (every kind whose C
    kernels stream bf16 weights), float32 on the portable kind (bf16 emulated element-wise).

    Weights in GGUF blocks (``gguf_blocks``) take float32 activations on every kind: their kernels
    widen bf16 activations to float32 anyway (the weight bytes, not the activations', set one-row
    speed), and bf16 activations round away near-ties the reference keeps. The embedded model's first
    answer token to "What is the capital of France?" is such a tie ("The" leads "L" by 0.08 logits
    in HF's float32): bf16 activations with the dense path's prefill answer "L'Etoile, la
    Marseillaise, ...", float32 ones "The capital of France is Paris.", as HF does."""
    kind = requested_kind() if kind is None else kind
    return "bfloat16" if PLANS[kind].c_max_rows > 0 and not gguf_blocks else "float32"


def quantized_types(use_kernels: bool) -> frozenset[int]:
    """The ggml block types this CPU's kernels compute on (empty: kernels off or not built)."""
    kernels = cpu_kernels.load(requested_kind()) if use_kernels else None
    return frozenset() if kernels is None else frozenset(t for t in QUANT_TYPES if kernels.quant_supported(t))


def kernels_library(use_kernels: bool) -> Path | None:
    """The built C kernels' library file, whatever the model (None: kernels off or not built)."""
    kernels = cpu_kernels.load(requested_kind()) if use_kernels else None
    return None if kernels is None else kernels.path


def prepare_model(model: nn.Module, dtype: torch.dtype, use_kernels: bool, compiled: bool) -> CpuSetup:
    """Steps 1-6 of the module docstring, on a model just loaded on the CPU."""
    kind = requested_kind()
    shapes = (model.num_heads, model.num_kv_heads, model.head_dim, dtype)
    fits = use_kernels and cpu_kernels.CpuKernels.supports(*shapes)  # type: ignore[arg-type]
    kernels = cpu_kernels.load(kind) if fits else None
    paths: Counter[str] = Counter()
    _attach_quantized(model, dtype, kernels, paths)
    routed = _attach_routers(model, dtype, kernels) if kernels is not None and not compiled else set()
    if not compiled:
        for module in model.modules():
            if id(module) in routed:  # its QuantRouter holds the weight: no matmul copy of it
                continue
            if isinstance(module, Linear) and module.impl is None and module.weight.dtype in _CPU_LINEAR:
                impl = CpuLinear(module.weight, module.bias, kind, kernels)
                module.impl = impl
                paths.update(name for name, has in impl.paths.items() if has)
    fused = kernels if not compiled else None
    for module in model.modules():
        if hasattr(type(module), "fused"):
            setattr(module, "fused", fused)  # noqa: B010 (nn.Module types attributes as Tensor | Module)
    _drop_owned_weights(model)
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
    decode = fused_decode(model, kernels, dtype) if not compiled else None
    keep_freed_memory()  # the weights are in place: from here on, steps reuse what they free
    return CpuSetup(kind=kind, kernels=kernels, decode_layers=decode)


def _attach_quantized(
    model: nn.Module, dtype: torch.dtype, kernels: cpu_kernels.CpuKernels | None, paths: Counter[str]
) -> None:
    """QuantLinear / QuantEmbedding for every module the loader gave quantized blocks, the legacy
    types' rows interleaved by 8 first (csrc/quant_x8.c; a tied head and its embedding share one)."""
    import gguf

    interleaved: dict[int, tuple[QuantizedWeight, QuantizedWeight]] = {}  # id: (as loaded, interleaved)
    arena = HugePageArena(arena_bytes([p.data.numel() for p in _relaid_parts(model)]))
    for module in model.modules():
        weight = getattr(module, "quantized", None)
        if weight is None:
            continue
        assert kernels is not None, "quantized weights are loaded only where the kernels run"
        if isinstance(module, Experts) and isinstance(weight, QuantizedExperts):  # experts.py
            module.quantized = interleave_experts(weight, arena)
            module.impl = QuantExperts(module.quantized, kernels, module.act, module.act_mul)
            paths["gguf experts"] += 1
            continue
        if id(weight) not in interleaved:
            parts = tuple(
                interleave_rows(part, arena.take(tuple(part.data.shape)) if interleaves(part) else None)
                for part in weight.parts
            )
            interleaved[id(weight)] = (weight, QuantizedWeight(parts))
        weight = interleaved[id(weight)][1]
        setattr(module, "quantized", weight)  # noqa: B010 (nn.Module types attributes as Tensor | Module)
        types = "+".join(gguf.GGMLQuantizationType(part.type).name for part in weight.parts)
        if isinstance(module, Linear):
            module.impl = QuantLinear(weight, module.bias, kernels)
            paths[f"gguf {types}"] += 1
        elif isinstance(module, Embedding):
            module.impl = QuantEmbedding(weight, dtype, kernels)


def _relaid_parts(model: nn.Module) -> list[QuantBlocks]:
    """Every block tensor ``_attach_quantized`` re-lays (once each, a tied head's with its embedding's)."""
    seen: dict[int, QuantBlocks] = {}
    for module in model.modules():
        weight = getattr(module, "quantized", None)
        if isinstance(module, Experts) and isinstance(weight, QuantizedExperts):
            found = relaid_experts(weight)
        elif isinstance(weight, QuantizedWeight):
            found = [part for part in weight.parts if interleaves(part)]
        else:
            found = []
        seen |= {id(part): part for part in found}
    return list(seen.values())


def _attach_routers(model: nn.Module, dtype: torch.dtype, kernels: cpu_kernels.CpuKernels) -> set[int]:
    """A QuantRouter for every sparse block whose experts are on blocks (a GGUF's), so the modules
    route as the one-call decode does (experts.py); returns the ids of the gate Linears it replaces."""
    routed = set()
    for module in model.modules():
        if isinstance(module, SparseMoeBlock) and isinstance(module.experts.impl, QuantExperts):
            weight = module.gate.weight.to(dtype)
            module.router = QuantRouter(weight, module.top_k, module.norm_topk_prob, kernels)
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
        impl = getattr(module, "impl", None)
        if impl is not None and hasattr(impl, "tensors"):
            held.extend(impl.tensors())
        for tensor in held:
            if tensor.device.type == "cpu" and tensor.numel() and not tensor.is_mkldnn:
                storage = tensor.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
            elif tensor.numel():  # oneDNN's blocked tensors have no storage to ask
                seen[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def _drop_owned_weights(model: nn.Module) -> None:
    """A Linear whose CpuLinear holds its copies keeps an empty weight: the loaded tensor is freed
    unless another module (a tied embedding) still holds it."""
    for module in model.modules():
        if isinstance(module, Linear) and module.impl is not None:
            module.weight = nn.Parameter(torch.empty(0, dtype=module.weight.dtype), requires_grad=False)


def pin_attributes(model: nn.Module) -> None:
    """Put every module's submodules, parameters and buffers in its instance ``__dict__``.

    nn.Module keeps them in side tables reached through ``__getattr__``, a Python call per
    lookup, far slower than an instance-dict hit; a decode step makes ~30 such lookups per layer,
    a visible share of a one-row step (docs/benchmarks.md, "Numbers behind the code's choices").
    Reassigning one later stays correct: nn.Module's ``__setattr__`` drops the instance-dict entry
    before it registers the new value.
    """
    for module in model.modules():
        for table in (module._modules, module._parameters, module._buffers):
            for name, value in table.items():
                if value is not None:
                    module.__dict__[name] = value


class CpuBackend:
    """The CPU kinds' backend: C kernels for decode attention, small ops, argmax and GGUF block
    matmuls where built (else torch's paths), weight layouts per kind, and the thread tuner."""

    name = "cpu"
    host_memory = True

    def __init__(self, config: WorkerConfig) -> None:
        self.device = torch.device("cpu")
        self.config = config
        self.kernels: cpu_kernels.CpuKernels | None = None  # set by prepare_model where they fit
        self.fused_decode: FusedDecode | None = None  # all decoder layers in one call, on decode steps
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(config.num_threads or cores)
        self._tuner: ThreadTuner | None = None
        self._guard: ContentionGuard | None = None
        if config.num_threads == 0 and cores > 1:
            if config.tune_threads:
                self._tuner = ThreadTuner((cores, max(1, cores // 2)))
            elif run_delay_s() is not None:
                self._guard = ContentionGuard(cores)
        self._shape: tuple[str, int] | None = None
        self._threads = torch.get_num_threads()
        self._delay_before_s = 0.0

    def auto_dtype(self, gguf_blocks: bool) -> str:
        return auto_dtype(gguf_blocks=gguf_blocks)

    def kv_cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """KV_AUTO_16BIT under float32 activations where the C kernels attend (they read it in place,
        widening each row in registers); the activations' dtype where torch's paths attend."""
        return KV_AUTO_16BIT if dtype == torch.float32 and self.kernels is not None else dtype

    def quantized_types(self) -> frozenset[int]:
        return quantized_types(self.config.cpu_kernels)

    def kv_pool_tokens(self, configured: int, mem_fraction: float, bytes_per_token: int) -> int:
        return kv_pool_tokens(configured, mem_fraction, bytes_per_token, self.device)

    def prepare_model(self, model: nn.Module, dtype: torch.dtype, tp: TensorParallel | None) -> None:
        def prepare() -> None:  # on this rank's shard under tensor parallel
            if self.config.compile:
                compile_layers(model)
            setup = prepare_model(model, dtype, self.config.cpu_kernels, self.config.compile)
            self.kernels, self.fused_decode = setup.kernels, setup.decode_layers

        tensor_parallel.prepare_rank(model, tp, prepare)

    def init_forward_metadata(
        self, kv: KVPool, req_pool_idx: list[int], prefix_lens: list[int], extend_lens: list[int]
    ) -> tuple[torch.Tensor, Any]:
        if self.kernels is None:
            return torch_attention.build_metadata(
                kv.page_table, kv.page_size, req_pool_idx, prefix_lens, extend_lens, self.device
            )
        return cpu_attention.build_metadata(
            self.kernels, kv.page_table, kv.page_size, req_pool_idx, prefix_lens, extend_lens
        )

    def attention(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext,
        options: AttentionOptions,
    ) -> torch.Tensor:
        k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]
        if self.kernels is None:
            return torch_attention.attend(ctx.attn, q, k, v, k_cache, v_cache, options)
        return cpu_attention.attend(self.kernels, ctx.attn, q, k, v, k_cache, v_cache, options)

    def forward_decode(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        return self.fused_decode(input_ids, ctx) if self.fused_decode is not None else None

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """The C argmax (one pass over each row, faster than torch's: docs/benchmarks.md)
        where the kernels take the logits' dtype; float32 holds every bf16 value exactly, so it picks
        what a float32 argmax picks."""
        if self.kernels is not None and logits.stride(1) == 1 and logits.dtype in cpu_kernels.DTYPE_CODES:
            return self.kernels.argmax(logits)
        return logits.max(dim=-1).indices

    def all_reduce(self, config: WorkerConfig) -> ALL_REDUCE:
        from gpu_worker.backends.cpu.shm_allreduce import pick_all_reduce

        return pick_all_reduce(config)

    def before_batch(self, rows: int, tokens: int) -> None:
        """Set the torch thread count the tuner picks for this batch's shape class, or the guard's."""
        if self._guard is not None:
            self._delay_before_s = run_delay_s() or 0.0
        if self._tuner is None:
            return
        self._shape = shape_class(rows, tokens)
        self._threads = self._tuner.choose(self._shape)
        if self._threads != torch.get_num_threads():
            torch.set_num_threads(self._threads)

    def after_batch(self, seconds: float) -> None:
        if self._tuner is not None and self._shape is not None:
            self._tuner.record(self._shape, self._threads, seconds)
        if self._guard is not None:
            waited_s = (run_delay_s() or 0.0) - self._delay_before_s
            threads = self._guard.record(seconds, waited_s)
            if threads != torch.get_num_threads():
                why = (
                    "its steps wait for a core" if threads < self._guard.full else "the cores are free again"
                )
                logger.info("worker threads %d -> %d: %s", torch.get_num_threads(), threads, why)
                torch.set_num_threads(threads)


def run_delay_s() -> float | None:
    """Seconds this thread has waited on a run queue for a core (Linux schedstat), None where the
    kernel does not tell."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def compile_layers(model: nn.Module) -> None:
    """--compile: torch.compile every decoder layer's forward."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        logger.warning("--compile: %s has no layers to compile; running eagerly", type(model).__name__)
        return
    for layer in layers:
        layer.compile(dynamic=True)
