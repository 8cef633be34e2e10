"""The CPU backend (``CpuBackend``): the CPU kinds, their C kernels, weight layouts and matmul paths,
the one-call decode and the thread tuner. Its readying of a loaded model, through the layer
contract, is prepare.py's ``prepare_model``."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from gpu_worker import tensor_parallel
from gpu_worker.backends.base import ALL_REDUCE
from gpu_worker.backends.cpu import attention as cpu_attention
from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.decode_gemma4 import Gemma4Decode
from gpu_worker.backends.cpu.decode_hybrid import HybridDecode
from gpu_worker.backends.cpu.decode_layers import FusedDecode
from gpu_worker.backends.cpu.decode_mla import MlaDecode
from gpu_worker.backends.cpu.kind import CpuKind, requested_kind
from gpu_worker.backends.cpu.matmul import PLANS
from gpu_worker.backends.cpu.prepare import CpuSetup as CpuSetup
from gpu_worker.backends.cpu.prepare import pin_attributes as pin_attributes
from gpu_worker.backends.cpu.prepare import prepare_model
from gpu_worker.backends.cpu.prepare import weight_bytes as weight_bytes
from gpu_worker.backends.cpu.threads import ContentionGuard, ThreadTuner, shape_class
from gpu_worker.backends.memory import kv_pool_ceiling, kv_pool_tokens
from gpu_worker.backends.torch import attention as torch_attention

if TYPE_CHECKING:
    from gpu_worker.config import WorkerConfig
    from gpu_worker.forward_context import AttentionOptions, ForwardContext
    from gpu_worker.kv_cache import KVPool
    from gpu_worker.models import CausalLM
    from gpu_worker.tensor_parallel import TensorParallel

logger = logging.getLogger(__name__)


# ggml type ids with kernels in csrc/quant*.c (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K; Q5_0, Q5_1,
# IQ4_NL, IQ4_XS, MXFP4; Q2_K, Q3_K; F16, BF16 weights kept 16-bit), where built.
QUANT_TYPES = (2, 3, 8, 12, 13, 14, 6, 7, 20, 23, 1, 30, 39, 10, 11)
# --kv-cache-dtype auto under float32 activations, where the C kernels attend: half the bytes a
# decode step reads per position (at 2048 positions one stream's KV outweighs the embedded model's
# weights). float16 over bfloat16: 3 more mantissa bits, and the kernels widen either in one
# instruction. On the embedded model's exactness prompts, teacher-forced, float16 KV moves the
# logits by at most 0.018 from float32 KV's, bfloat16 by up to 0.18, more than the 0.08 by which
# its first answer token to "What is the capital of France?" leads. (llama.cpp's default is f16 too.)
KV_AUTO_16BIT = torch.float16


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


class CpuBackend:
    """The CPU kinds' backend: C kernels for decode attention, small ops, argmax and GGUF block
    matmuls where built (else torch's paths), weight layouts per kind, and the thread tuner."""

    name = "cpu"
    host_memory = True

    def __init__(self, config: WorkerConfig) -> None:
        self.device = torch.device("cpu")
        self.config = config
        self.kernels: cpu_kernels.CpuKernels | None = None  # set by prepare_model where they fit
        # all decoder layers in one call, on decode steps
        self.fused_decode: FusedDecode | MlaDecode | HybridDecode | Gemma4Decode | None = None
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

    def tower_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """bfloat16 for float32 activations where the CPU multiplies bf16 natively (AVX512-BF16, AMX):
        a tower is compute-bound, and there bf16 products are twice float32's a cycle (the measured
        gain: docs/benchmarks-history.md); elsewhere bf16 is emulated, slower than float32."""
        native = requested_kind().rank >= CpuKind.AVX512_BF16.rank
        return torch.bfloat16 if dtype == torch.float32 and native else dtype

    def kv_cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """KV_AUTO_16BIT under float32 activations where the C kernels attend (they read it in place,
        widening each row in registers); the activations' dtype where torch's paths attend."""
        return KV_AUTO_16BIT if dtype == torch.float32 and self.kernels is not None else dtype

    def quantized_types(self) -> frozenset[int]:
        return quantized_types(self.config.cpu_kernels)

    def kv_pool_tokens(self, configured: int, mem_fraction: float, bytes_per_token: int) -> int:
        return kv_pool_tokens(configured, mem_fraction, bytes_per_token, self.device)

    def kv_pool_ceiling(self, configured: int) -> int | None:
        return kv_pool_ceiling(configured, self.device)

    def prepare_model(self, model: nn.Module, dtype: torch.dtype, tp: TensorParallel | None) -> None:
        def prepare() -> None:  # on this rank's shard under tensor parallel
            if self.config.compile:
                compile_layers(cast("CausalLM", model))
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
        blocks = ctx.images.blocks if ctx.images is not None else None
        if self.kernels is None:
            return torch_attention.attend(ctx.attn, q, k, v, k_cache, v_cache, options, blocks=blocks)
        if blocks:  # an image's tokens attend both ways: torch's masks, every row (the kernel is causal)
            meta = ctx.attn.torch_metadata()
            return torch_attention.attend(meta, q, k, v, k_cache, v_cache, options, blocks=blocks)
        return cpu_attention.attend(self.kernels, ctx.attn, q, k, v, k_cache, v_cache, options)

    def forward_decode(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        return self.fused_decode(input_ids, ctx) if self.fused_decode is not None else None

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """The C argmax (one pass over each row, faster than torch's: docs/benchmarks-history.md)
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


def compile_layers(model: CausalLM) -> None:
    """--compile: torch.compile every decoder layer's forward."""
    for layer in model.decoder_layers():
        layer.compile(dynamic=True)
