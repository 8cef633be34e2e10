"""The worker's C kernels for CPU (csrc/*.c): attention of decode rows over the paged KV, the dense
layers' small ops (RMSNorm, rotary, silu * up) in one call each, the few-row bf16 matmul of decode
steps, the greedy argmax, and (quant_kernels.py) the matmuls and row lookup of GGUF weights kept
in their blocks and the one-call decode of a model on them.

Why C: torch has no paged attention on CPU. Its SDPA wants each decode row's KV
gathered into a padded copy first. The kernel walks each row's pages in place
instead, every row at its own length (no padding), prefetching the scattered
pages ahead of use, scoring 16 positions per step in vector registers (two
8-lane vectors on AVX2, one on AVX-512). The small ops replace 2-8 torch
dispatches each (each a fixed cost that small tensors do not hide:
docs/benchmarks.md) with one call, reproducing the torch code's roundings (bf16:
bit-equal). The matmul streams plain [out, in] bf16 weights, widened to fp32 in
registers where the CPU has no bf16 dot product: decode is bound by memory, so half the bytes of
fp32 weights is most of the speed.

Built per CPU kind by build.py. No compiler, or a failed build: ``load()`` returns None, the
reason is logged once, and the worker keeps its torch paths.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import torch

from gpu_worker.backends.cpu import abi
from gpu_worker.backends.cpu.build import (
    BUILDS,
    DTYPE_CODES,
    ISA_PORTABLE,
    KV_DTYPE_CODES,
    LATENT_KV_DTYPE_CODES,
    build,
)
from gpu_worker.backends.cpu.decode_rows import DecodeRows
from gpu_worker.backends.cpu.kind import CpuKind, is_x86, weight_prefetch_nta
from gpu_worker.backends.cpu.quant_kernels import QuantKernels

logger = logging.getLogger(__name__)

# csrc/rivulet_kernels.h's limits of the attention: heads, head_dim, and heads times head_dim (each head
# in whole 32-dimension blocks: 64 heads of 256 or 32 of 512); larger shapes use torch.
MAX_HEADS, MAX_HEAD_DIM, MAX_QUERY_WIDTH = 64, 512, 16384


class CpuKernels(QuantKernels):
    """ctypes bindings of a built library; every method takes CPU tensors."""

    def __init__(self, path: Path, kind: CpuKind) -> None:
        lib = ctypes.CDLL(str(path))
        self.path = path
        self.kind = kind
        self._kernel_isa = lib.kernel_isa
        self._kernel_isa.argtypes, self._kernel_isa.restype = [], ctypes.c_int
        self.isa = int(self._kernel_isa())
        expected = BUILDS[kind][1] if is_x86() else ISA_PORTABLE
        if self.isa != expected:
            raise RuntimeError(f"kernels for {kind.value} built as ISA {self.isa}, not {expected}")
        ctypes.c_int.in_dll(lib, "weight_prefetch_nta").value = int(weight_prefetch_nta())
        self._attention = lib.paged_decode_attention
        self._attention.restype = ctypes.c_int
        self._attention.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
            ctypes.c_void_p,
        ]  # fmt: skip

        i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
        self._rms_norm = lib.rms_norm
        self._rms_norm.argtypes = [ptr, i64, ptr, ptr, i64, i32, f32, i32]
        self._rotary = lib.rotary
        self._rotary.argtypes = [ptr, i64, i64, i32, i32, ptr, ptr, i32]
        self._silu_mul = lib.silu_mul
        self._silu_mul.argtypes = [ptr, ptr, i64, i32, i32]
        self._gelu_tanh_mul = lib.gelu_tanh_mul
        self._gelu_tanh_mul.argtypes = [ptr, ptr, i64, i32, i32]
        self._matmul = lib.matmul_bf16
        self._matmul.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, i32, i32, i32]
        self._argmax = lib.argmax_rows
        self._argmax.argtypes = [ptr, i64, i64, i32, i32, ptr]
        self._softcap = lib.softcap_f32
        self._softcap.argtypes = [ptr, i64, f32]
        for fn in (
            self._rms_norm,
            self._rotary,
            self._silu_mul,
            self._gelu_tanh_mul,
            self._matmul,
            self._argmax,
            self._softcap,
        ):
            fn.restype = None
        self._latent = lib.latent_decode_attention
        self._latent.restype = i32
        self._latent.argtypes = [
            ptr, i64, ptr, ptr, i64, i32, i32, ptr, ptr, ptr, ptr, i64, i64, i32, i32, i32, i32, f32,
        ]  # fmt: skip
        self._bind_quant(lib)
        abi.check_kernels(self)
        abi.check([], {}, {"MAX_QUERY_WIDTH": MAX_QUERY_WIDTH})

    @staticmethod
    def supports(num_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
        """Whether ``decode_attention`` takes a model of these head shapes in this dtype."""
        return (
            dtype in DTYPE_CODES
            and num_heads % kv_heads == 0
            and num_heads <= MAX_HEADS
            and head_dim <= MAX_HEAD_DIM
            and num_heads * -(-head_dim // 32) * 32 <= MAX_QUERY_WIDTH
        )

    def decode_rows(
        self,
        q_rows: torch.Tensor,
        req_pool_idx: torch.Tensor,
        kv_lens: torch.Tensor,
        page_table: torch.Tensor,
        page_size: int,
    ) -> DecodeRows:
        """The raw arguments for ``attend`` of decode rows: checked once, used by every layer.
        Row i reads q row q_rows[i] and attends positions [0, kv_lens[i]) of page-table row
        req_pool_idx[i]."""
        assert page_table.is_contiguous() and page_table.dtype == torch.int64
        for t in (q_rows, req_pool_idx, kv_lens):
            assert t.dtype == torch.int64 and t.is_contiguous() and len(t) == len(q_rows)
        return DecodeRows(
            q_rows.data_ptr(), req_pool_idx.data_ptr(), kv_lens.data_ptr(), page_table.data_ptr(),
            page_table.shape[1], len(q_rows), page_size, (q_rows, req_pool_idx, kv_lens, page_table),
        )  # fmt: skip

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        rows: DecodeRows,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        sliding_window: int = 0,
        scale: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """out[q_rows[i]] = softmax(q[q_rows[i]] K^T * scale) V for each of ``rows`` (scale 1 / sqrt(D)
        unless given; ``sliding_window`` > 0: each row attends its last ``sliding_window`` positions);
        q, out: [T, Hq, D]; caches [N, Hkv, D] (contiguous; float32, bfloat16 or float16, any q dtype).
        ``new_kv``: k, v [T, Hkv, D] (heads contiguous, q's dtype) of which row i's K/V (row q_rows[i])
        are first written at its last position, rounded to the caches' dtype. ``sinks``: [Hq] float32
        logits, one more term in each head's softmax with no value (gpt-oss's)."""
        _, heads, head_dim = q.shape
        assert q.stride(2) == 1 and q.stride(1) == head_dim, "q: heads and head_dim must be contiguous"
        k_ptr = v_ptr = k_stride = v_stride = 0
        if new_kv is not None:
            k, v = new_kv
            k_ptr, v_ptr, k_stride, v_stride = k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0)
        if sinks is not None:
            assert sinks.dtype == torch.float32 and sinks.is_contiguous() and sinks.shape == (heads,)
        status: int = self._attention(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
            DTYPE_CODES[q.dtype], KV_DTYPE_CODES[k_cache.dtype], rows.q_rows, rows.req_pool_idx, rows.kv_lens,
            rows.page_table, rows.pt_stride,
            rows.rows, heads, k_cache.shape[1], head_dim, rows.page_size,
            head_dim**-0.5 if scale is None else scale, k_ptr, k_stride, v_ptr, v_stride, sliding_window,
            0 if sinks is None else sinks.data_ptr(),
        )  # fmt: skip
        assert status == 0, (
            f"paged_decode_attention refused ({abi.status_text(status)}) heads {heads}/{k_cache.shape[1]}, "
            f"head_dim {head_dim}, {q.dtype} over a {k_cache.dtype} KV cache"
        )

    def latent_attend(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        out: torch.Tensor,
        rows: DecodeRows,
        v_dim: int,
        scale: float,
    ) -> None:
        """Latent attention's absorbed decode (csrc/mla.c): out[q_rows[i], h] = softmax(q[q_rows[i], h]
        C^T * scale) C[:, :v_dim] for each of ``rows``, C the row's positions of ``cache`` [N, 1, D]
        (float32, bfloat16, float16 or float8_e4m3fn), every head in one pass over them; q [T, H, D] and
        out [T, H, v_dim] with heads contiguous, of one dtype (float32 or bfloat16)."""
        _, heads, dim = q.shape
        assert q.stride(2) == 1 and q.stride(1) == dim, "q: heads and head_dim must be contiguous"
        assert cache.is_contiguous() and cache.shape[1:] == (1, dim)
        assert out.dtype == q.dtype and out.stride(2) == 1 and out.stride(1) == v_dim
        status: int = self._latent(
            q.data_ptr(), q.stride(0), cache.data_ptr(), out.data_ptr(), out.stride(0), DTYPE_CODES[q.dtype],
            LATENT_KV_DTYPE_CODES[cache.dtype], rows.q_rows, rows.req_pool_idx, rows.kv_lens, rows.page_table,
            rows.pt_stride, rows.rows, heads, dim, v_dim, rows.page_size, scale,
        )  # fmt: skip
        assert status == 0, f"latent_decode_attention refused ({abi.status_text(status)}): {heads} x {dim}"

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        q_rows: torch.Tensor,
        req_pool_idx: torch.Tensor,
        kv_lens: torch.Tensor,
        page_table: torch.Tensor,
        page_size: int,
    ) -> None:
        """``attend`` in one call, for one-off use (tests)."""
        assert out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
        self.attend(
            q, k_cache, v_cache, out, self.decode_rows(q_rows, req_pool_idx, kv_lens, page_table, page_size)
        )

    # The dense layer's small ops: one call each where torch takes 2-8 (RMSNorm, rotary, silu * up).
    # Same roundings as the torch code they replace; callers check layout (rows stride, last dim 1).

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """HF RMSNorm of x [T, dim] (rows may be strided) with ``weight`` [dim] of x's dtype."""
        out = torch.empty(x.shape, dtype=x.dtype)
        self._rms_norm(
            x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
            DTYPE_CODES[x.dtype],
        )  # fmt: skip
        return out

    def rotary_(self, x: torch.Tensor, heads: int, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
        """Rotate heads [0, heads) of x [T, H, D] in place; cos / signed_sin [T, 1, D] contiguous, D at
        most MAX_HEAD_DIM (the kernel's per-row arrays)."""
        assert x.shape[2] <= MAX_HEAD_DIM, f"rotary of {x.shape[2]}-wide heads"
        self._rotary(
            x.data_ptr(), x.stride(0), x.shape[0], heads, x.shape[2], cos.data_ptr(), signed_sin.data_ptr(),
            DTYPE_CODES[x.dtype],
        )  # fmt: skip

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of contiguous gate_up [T, 2 * inner] -> [T, inner]."""
        rows, inner = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, inner), dtype=gate_up.dtype)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, inner, DTYPE_CODES[gate_up.dtype])
        return out

    def softcap_(self, x: torch.Tensor, cap: float) -> None:
        """x = cap * tanh(x / cap) in place, x contiguous float32 (within float32 rounding of torch's)."""
        assert x.dtype == torch.float32 and x.is_contiguous()
        self._softcap(x.data_ptr(), x.numel(), cap)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up of contiguous gate_up [T, 2 * inner] -> [T, inner] (Gemma's MLP)."""
        rows, inner = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, inner), dtype=gate_up.dtype)
        self._gelu_tanh_mul(gate_up.data_ptr(), out.data_ptr(), rows, inner, DTYPE_CODES[gate_up.dtype])
        return out

    def matmul(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [M, K] @ weight.T (+ bias) (+ residual) -> [M, N], all bfloat16; weight [N, K] row-major
        (not oneDNN-packed) and contiguous; x and residual rows may be strided (last dim contiguous).
        One rounding of the float32 sum."""
        n, k = weight.shape
        m = x.shape[0]
        assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1), "rows must be contiguous"
        out = torch.empty((m, n), dtype=torch.bfloat16)
        self._matmul(
            x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
            None if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
            out.data_ptr(), m, n, k,
        )  # fmt: skip
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """The first index of each row's largest value of [R, V] float32/bf16 logits (rows may be
        strided; NaN-free), as int64 [R]: torch's max(dim=-1).indices, several times faster."""
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self._argmax(
            logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], DTYPE_CODES[logits.dtype],
            out.data_ptr(),
        )  # fmt: skip
        return out


@functools.cache
def load(kind: CpuKind) -> CpuKernels | None:
    """The kernels for ``kind``, built on first use; None (logged once) where they cannot be."""
    try:
        return CpuKernels(build(kind), kind)
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:  # not abi.AbiMismatch: a bug
        logger.warning("CPU kernels unavailable, using torch paths: %s", exc)
        return None
