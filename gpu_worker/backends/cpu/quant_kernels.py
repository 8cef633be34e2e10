"""The C kernels over GGUF blocks (csrc/quant*.c, decode_layers.c), as ``CpuKernels`` methods.

``type`` is ggml's type id (gguf.GGMLQuantizationType), ``w`` the [n, row bytes] uint8 blocks as the
file holds them; or that id | ``X8`` (layouts.py) for the legacy types' rows interleaved by 8
(csrc/quant_x8.c), the layout the worker holds them in.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import TYPE_CHECKING, Any, NamedTuple

import gguf
import torch

from gpu_worker.backends.cpu.abi import status_text
from gpu_worker.backends.cpu.build import DTYPE_CODES
from gpu_worker.backends.cpu.layouts import A8, X8

if TYPE_CHECKING:
    from gpu_worker.backends.cpu.decode_rows import DecodeRows


class ClampedAct(NamedTuple):
    """gpt-oss's experts' extras for ``moe_experts``: the biases ([E, 2 * inner] gate's then up's,
    [E, hidden], in the activations' dtype) and the clamped SwiGLU's alpha and limit."""

    gate_up_bias: torch.Tensor
    down_bias: torch.Tensor
    alpha: float
    limit: float


class QuantKernels:
    """The GGUF-block half of ``CpuKernels``: bound by ``_bind_quant`` on the loaded library."""

    def _bind_quant(self, lib: ctypes.CDLL) -> None:
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        self._quant_supported = lib.quant_supported
        self._quant_supported.argtypes = [i32]
        self._quant_supported.restype = i32
        self._quant_act_row_bytes = lib.quant_act_row_bytes
        self._quant_act_row_bytes.argtypes = [i32, i64]
        self._quant_act_row_bytes.restype = i64
        self._quant_matmul = lib.quant_matmul
        self._quant_matmul.argtypes = [i32, ptr, i64, i64, ptr, i64, i32, i64, ptr, ptr, i64, i32, ptr, i64]
        self._quant_matmul.restype = i32
        self._quant_matmul_gated = lib.quant_matmul_gated
        self._quant_matmul_gated.argtypes = [i32, ptr, ptr, i64, i64, ptr, i64, i32, i64, ptr, ptr, i32, i32]
        self._quant_matmul_gated.restype = i32
        self._quant_matmul_dense = lib.quant_matmul_dense
        self._quant_matmul_dense.argtypes = [i32, ptr, i64, i64, ptr, i64, i32, i64, ptr, i64, i32, ptr, i64]
        self._quant_matmul_dense.restype = i32
        self._quant_matmul_argmax = lib.quant_matmul_argmax
        f32 = ctypes.c_float
        self._quant_matmul_argmax.argtypes = [i32, ptr, i64, i64, ptr, i64, i32, i64, ptr, i32, f32, ptr]
        self._quant_matmul_argmax.restype = i32
        self._head_screen_build = lib.head_screen_build
        self._head_screen_build.argtypes = [i32, ptr, i64, i64, ptr, ptr, ptr]
        self._head_screen_build.restype = i32
        self._head_screen_argmax = lib.head_screen_argmax
        self._head_screen_argmax.argtypes = [
            *(i32, ptr, i64, i64, ptr, ptr, ptr, ptr, i32, i64),
            *(ptr, ptr, ptr, ptr),
        ]
        self._head_screen_argmax.restype = i32
        self._quant_get_rows = lib.quant_get_rows
        self._quant_get_rows.argtypes = [i32, ptr, i64, ptr, i64, ptr, i32]
        self._quant_get_rows.restype = None
        self._quantize_act8 = lib.quantize_act8
        self._quantize_act8.argtypes = [ptr, i64, ptr]
        self._quantize_act8.restype = None
        self._quant_act8_block_bytes = lib.quant_act8_block_bytes
        self._quant_act8_block_bytes.argtypes, self._quant_act8_block_bytes.restype = [], i64
        self.act8_block_bytes = int(self._quant_act8_block_bytes())  # sizeof(act_block8), csrc/quant.h
        self._decode_layers = lib.decode_layers
        self._decode_layers.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64]
        self._decode_layers.restype = i32
        self._moe_experts = lib.moe_experts
        self._moe_experts.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i64, ptr, i32]
        self._moe_experts.restype = i32
        self._moe_experts_clamped = lib.moe_experts_clamped
        self._moe_experts_clamped.argtypes = [*self._moe_experts.argtypes, ptr, ptr, f32, f32]
        self._moe_experts_clamped.restype = i32
        self._moe_route = lib.moe_route
        self._moe_route.argtypes = [ptr, i64, i64, ptr, i64, i64, i32, ptr, ptr, i32]
        self._moe_route.restype = i32
        self._moe_route_topk = lib.moe_route_topk
        self._moe_route_topk.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ptr, ptr, i32]
        self._moe_route_topk.restype = i32
        self._moe_group = lib.moe_group
        self._moe_group.argtypes = [ptr, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, i32]
        self._moe_group.restype = i32
        self._local = threading.local()
        self._act_row_bytes = functools.cache(lambda type, k: int(self._quant_act_row_bytes(type, k)))

    def quant_supported(self, type: int) -> bool:
        """Whether ``quant_matmul`` and ``quant_get_rows`` take weights of this ggml type."""
        return bool(self._quant_supported(type))

    def quant_matmul(
        self,
        type: int,
        w: torch.Tensor,
        k: int,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        dense: bool = False,
    ) -> torch.Tensor:
        """x [M, K] @ W.T (+ residual) -> [M, N] in x's dtype (float32 or bfloat16), W [N, K] held as
        blocks ``w`` (uint8 [N, row bytes], contiguous). x rows are quantized to 16 bits per block of
        32 (csrc/quant.h), or to 8 where ``type`` has the ``A8`` flag (act_block8), or with ``dense``
        meet W dequantized to float32 (csrc/quant_dense.c); sums in float32, one rounding at the end.
        x and residual rows may be strided (last dim contiguous); residual [M, N] in x's dtype."""
        return self.quant_matmul_checked(type, w, k, x, residual, self.quant_check(type, w, k), dense)

    def quant_check(self, type: int, w: torch.Tensor, k: int) -> int:
        """Check blocks ``w`` of ``type`` for k columns once; returns the bytes of an activation row."""
        act_bytes = int(self._act_row_bytes(type, k))
        if act_bytes == 0:
            raise ValueError(f"quant_matmul: type {type} unsupported or k={k} not a whole number of blocks")
        assert w.dtype == torch.uint8 and w.is_contiguous() and w.dim() == 2, (
            "w: contiguous uint8 [n, row bytes]"
        )
        assert w.shape[1] == quant_row_bytes(type, k), f"w: {w.shape[1]} bytes a row, not k={k}'s"
        return act_bytes

    def quant_matmul_checked(
        self,
        type: int,
        w: torch.Tensor,
        k: int,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        act_bytes: int,
        dense: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``quant_matmul`` for blocks ``quant_check`` passed (it returned ``act_bytes``): what a
        Linear calls per step, with only the checks that depend on x. ``dense``: the many-row path
        (csrc/quant_dense.c), W dequantized panel by panel and x not quantized. ``out``: where to
        write [M, N] (rows may be strided: a merged Linear's part writes its columns in place)."""
        assert x.dim() == 2 and x.shape[1] == k and x.stride(1) == 1, "x: [M, k], rows contiguous"
        m, n = x.shape[0], w.shape[0]
        if out is None:
            out = torch.empty((m, n), dtype=x.dtype)
        assert out.shape == (m, n) and out.dtype == x.dtype and out.stride(1) == 1, "out: [M, N] in x's dtype"
        if residual is not None:
            assert residual.shape == (m, n) and residual.dtype == x.dtype and residual.stride(1) == 1
        res = (None, 0) if residual is None else (residual.data_ptr(), residual.stride(0))
        head = (type, w.data_ptr(), n, k, x.data_ptr(), x.stride(0), DTYPE_CODES[x.dtype], m)
        y = (out.data_ptr(), out.stride(0), DTYPE_CODES[x.dtype])
        if dense:
            status = self._quant_matmul_dense(*head, *y, *res)
        else:
            scratch = self._scratch(m * act_bytes)
            status = self._quant_matmul(*head, scratch.data_ptr(), *y, *res)
        if status != 0:
            refused = f"type {type}, n={n}, k={k}, dtype {x.dtype}: {status_text(status)}"
            raise ValueError(f"quant_matmul refused {refused}")
        return out

    def quant_matmul_gated(
        self,
        type: int,
        gate: torch.Tensor,
        up: torch.Tensor,
        k: int,
        x: torch.Tensor,
        act_bytes: int,
        gelu: bool,
    ) -> torch.Tensor:
        """``silu(x gate^T) * (x up^T)`` (``gelu``: gelu_tanh's) [M, inner] in x's dtype, for blocks
        ``quant_check`` passed (``act_bytes``), gate and up [inner, row bytes] of one type and layout:
        ``quant_matmul_checked`` of the two into one [M, 2 inner] output then ``silu_mul`` (or
        ``gelu_tanh_mul``), the same bits, in one call that never writes that output."""
        assert x.dim() == 2 and x.shape[1] == k and x.stride(1) == 1, "x: [M, k], rows contiguous"
        assert gate.shape == up.shape and gate.dtype == up.dtype == torch.uint8, (
            "gate, up: one shape of blocks"
        )
        m, inner = x.shape[0], gate.shape[0]
        out = torch.empty((m, inner), dtype=x.dtype)
        scratch = self._scratch(m * act_bytes)
        dtype = DTYPE_CODES[x.dtype]
        status = self._quant_matmul_gated(
            type, gate.data_ptr(), up.data_ptr(), inner, k, x.data_ptr(), x.stride(0), dtype, m,
            scratch.data_ptr(), out.data_ptr(), dtype, int(gelu),
        )  # fmt: skip
        if status != 0:
            refused = f"type {type}, inner={inner}, k={k}, dtype {x.dtype}: {status_text(status)}"
            raise ValueError(f"quant_matmul_gated refused {refused}")
        return out

    def quant_matmul_argmax(
        self,
        type: int,
        w: torch.Tensor,
        k: int,
        x: torch.Tensor,
        act_bytes: int,
        dense: bool = False,
        cap: float = 0.0,
    ) -> torch.Tensor:
        """The first index of each row's largest value (int64 [M]) of ``quant_matmul_checked``'s
        output (the same ``type`` and ``dense``), soft-capped as ``softcap_f32`` caps it where
        ``cap > 0`` (float32 x only), computed panel by panel without writing the output (csrc/quant.c's
        quant_matmul_argmax): an LM head's greedy draw."""
        assert x.dim() == 2 and x.shape[1] == k and x.stride(1) == 1, "x: [M, k], rows contiguous"
        m, n = x.shape[0], w.shape[0]
        out = torch.empty(m, dtype=torch.int64)
        scratch = None if dense else self._scratch(m * act_bytes).data_ptr()
        status = self._quant_matmul_argmax(
            type, w.data_ptr(), n, k, x.data_ptr(), x.stride(0), DTYPE_CODES[x.dtype], m, scratch, int(dense),
            cap, out.data_ptr(),
        )  # fmt: skip
        if status != 0:
            refused = f"type {type}, n={n}, k={k}, dtype {x.dtype}: {status_text(status)}"
            raise ValueError(f"quant_matmul_argmax refused {refused}")
        return out

    def head_screen_build(
        self, type: int, w: torch.Tensor, k: int, q: torch.Tensor, scale: torch.Tensor, radius: torch.Tensor
    ) -> bool:
        """Fill a 16-bit head's screen (csrc/head_screen.c): ``q`` uint8 [n, k] (int8 bits), ``scale``
        and ``radius`` float32 [n], from its rows ``w`` (uint8 [n, 2 k]). False where a weight is not
        finite (the head then keeps the full route)."""
        n = w.shape[0]
        assert q.dtype == torch.uint8 and q.shape == (n, k) and q.is_contiguous()
        assert scale.dtype == radius.dtype == torch.float32 and scale.shape == radius.shape == (n,)
        assert w.shape == (n, 2 * k) and w.is_contiguous()
        args = (type, w.data_ptr(), n, k, q.data_ptr(), scale.data_ptr(), radius.data_ptr())
        return self._head_screen_build(*args) == 0

    def head_screen_argmax(
        self,
        type: int,
        w: torch.Tensor,
        k: int,
        screen: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        out: torch.Tensor,
    ) -> None:
        """``quant_matmul_argmax``'s index for one row ``x`` ([1, k] or [k], float32 or bfloat16, not
        dense, no cap) by the screen (q, scale, radius: ``head_screen_build``'s) into ``out[0]``, the
        candidates counted into ``out[1]`` (-1: the full route ran); ``scratch``: approx (float32 [n]),
        cand (int64 [m]) and exact (float32 [m]) for at most m candidates (their rows and values)."""
        q, scale, radius = screen
        approx, cand, exact = scratch
        n = w.shape[0]
        assert x.numel() == k and x.is_contiguous() and out.dtype == torch.int64 and out.numel() >= 2
        assert approx.numel() >= n and cand.numel() == exact.numel()
        status = self._head_screen_argmax(
            type, w.data_ptr(), n, k, q.data_ptr(), scale.data_ptr(), radius.data_ptr(), x.data_ptr(),
            DTYPE_CODES[x.dtype], cand.numel(), approx.data_ptr(), cand.data_ptr(), exact.data_ptr(),
            out.data_ptr(),
        )  # fmt: skip
        if status != 0:
            raise ValueError(f"head_screen_argmax refused type {type}, n={n}, k={k}: {status_text(status)}")

    def _scratch(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` for quantized activations, reused by this thread's calls
        (an allocation per call costs about as much as a small matmul's compute)."""
        buf: torch.Tensor | None = getattr(self._local, "scratch", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._local.scratch = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
        return buf

    def quantize_act8(self, x: torch.Tensor) -> torch.Tensor:
        """One float32 row of k values (k a multiple of 256) as the 8-bit tiles meet it: k / 256
        csrc/quant.h ``act_block8`` structs, as uint8 [k / 256, act8_block_bytes] (for tests)."""
        assert x.dtype == torch.float32 and x.dim() == 1 and x.is_contiguous() and x.shape[0] % 256 == 0
        out = torch.zeros((x.shape[0] // 256, self.act8_block_bytes), dtype=torch.uint8)
        self._quantize_act8(x.data_ptr(), x.shape[0], out.data_ptr())
        return out

    def quant_get_rows(
        self, type: int, w: torch.Tensor, k: int, ids: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """Rows ``ids`` (int64 [T]) of W [N, K] held as blocks ``w``, dequantized -> [T, K] of ``dtype``
        (the embedding lookup)."""
        if self._act_row_bytes(type, k) == 0:
            raise ValueError(f"quant_get_rows: type {type} unsupported or k={k} not a whole number of blocks")
        assert w.dtype == torch.uint8 and w.is_contiguous() and w.dim() == 2
        assert w.shape[1] == quant_row_bytes(type, k), f"w: {w.shape[1]} bytes a row, not k={k}'s"
        assert ids.dtype == torch.int64 and ids.dim() == 1
        ids = ids.contiguous()
        assert len(ids) == 0 or (0 <= int(ids.min()) and int(ids.max()) < w.shape[0]), "ids out of range"
        out = torch.empty((len(ids), k), dtype=dtype)
        self._quant_get_rows(
            type, w.data_ptr(), k, ids.data_ptr(), len(ids), out.data_ptr(), DTYPE_CODES[dtype]
        )
        return out

    def decode_layers(
        self,
        layers: ctypes.Array[Any],
        n_layers: int,
        dims: ctypes.Structure,
        x: torch.Tensor,
        out: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rows: DecodeRows,
    ) -> None:
        """A Llama model's decoder layers over decode rows in one call (csrc/decode_layers.c; the
        structs are gpu_worker/backends/cpu/decode_layers.py's): out [T, hidden] from the embedding rows x,
        cos / sin [T, 1, head_dim] at the rows' positions, the attention's ``rows``."""
        status = self._decode_layers(
            ctypes.byref(layers), n_layers, ctypes.byref(dims), x.data_ptr(), out.data_ptr(), rows.rows,
            cos.data_ptr(), sin.data_ptr(), rows.q_rows, rows.req_pool_idx, rows.kv_lens, rows.page_table,
            rows.pt_stride, rows.page_size,
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"decode_layers failed: {status_text(status)}")

    def moe_experts(
        self,
        projections: ctypes.Array[Any],
        hidden: int,
        inner: int,
        x: torch.Tensor,
        tokens: torch.Tensor,
        weights: torch.Tensor,
        spans: torch.Tensor,
        clamped: ClampedAct | None = None,
    ) -> torch.Tensor:
        """A mixture of experts' experts over grouped rows in one call (csrc/moe.c; the structs are
        gpu_worker/backends/cpu/experts.py's): [T, hidden] in x's dtype from x [T, hidden] (contiguous),
        the pairs' ``tokens`` (int64) and ``weights`` (x's dtype) sorted by expert, and ``spans``
        (int64 [S, 3]: expert, start, count). With ``clamped``, gpt-oss's experts: biases on the
        projections and the clamped SwiGLU (moe_experts_clamped)."""
        assert x.is_contiguous() and x.dim() == 2 and x.shape[1] == hidden, "x: contiguous [T, hidden]"
        assert tokens.dtype == torch.int64 and tokens.is_contiguous() and spans.dtype == torch.int64
        assert weights.dtype == x.dtype and weights.is_contiguous() and len(weights) == len(tokens)
        out = torch.empty_like(x)
        args = (
            ctypes.byref(projections), hidden, inner, x.data_ptr(), tokens.data_ptr(), weights.data_ptr(),
            spans.data_ptr(), spans.shape[0], len(tokens), x.shape[0], out.data_ptr(), DTYPE_CODES[x.dtype],
        )  # fmt: skip
        if clamped is None:
            status = self._moe_experts(*args)
        else:
            for bias in (clamped.gate_up_bias, clamped.down_bias):
                assert bias.dtype == x.dtype and bias.is_contiguous(), "biases: contiguous, x's dtype"
            biases = (clamped.gate_up_bias.data_ptr(), clamped.down_bias.data_ptr())
            status = self._moe_experts_clamped(*args, *biases, clamped.alpha, clamped.limit)
        if status != 0:
            raise RuntimeError(f"moe_experts failed: {status_text(status)}")
        return out

    def moe_route(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        top_k: int,
        norm_topk: bool,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A mixture of experts' router in one call (csrc/moe.c): each row's top_k experts (int64
        [T, top_k], the likelier first) and their softmax probabilities, renormalised to sum to 1
        where ``norm_topk``, in x's dtype; x [T, hidden] and the router's ``weight`` [E, hidden]
        contiguous, of x's dtype. With a ``bias`` ([E], x's dtype), gpt-oss's router instead: the
        biased logits' top_k, and the softmax of those alone (moe_route_topk)."""
        assert x.is_contiguous() and weight.is_contiguous() and weight.dtype == x.dtype
        assert x.dim() == 2 and weight.dim() == 2 and weight.shape[1] == x.shape[1]
        ids = torch.empty((x.shape[0], top_k), dtype=torch.int64)
        weights = torch.empty((x.shape[0], top_k), dtype=x.dtype)
        rows, hidden, experts, dtype = x.shape[0], x.shape[1], weight.shape[0], DTYPE_CODES[x.dtype]
        if bias is None:
            status = self._moe_route(
                x.data_ptr(), rows, hidden, weight.data_ptr(), experts, top_k, int(norm_topk), ids.data_ptr(),
                weights.data_ptr(), dtype,
            )  # fmt: skip
        else:
            assert bias.is_contiguous() and bias.dtype == x.dtype and bias.shape == (experts,)
            status = self._moe_route_topk(
                x.data_ptr(), rows, hidden, weight.data_ptr(), bias.data_ptr(), experts, top_k,
                ids.data_ptr(), weights.data_ptr(), dtype,
            )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"moe_route failed: {status_text(status)}")
        return ids, weights

    def moe_group(
        self, expert_ids: torch.Tensor, weights: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's top-k ``expert_ids`` (int64 [T, k], each below ``num_experts``) and their
        ``weights`` ([T, k], float32 or bfloat16) as ``moe_experts`` takes them, in one call
        (csrc/moe.c): the pairs sorted by expert, stably, as models/moe.py's ``ExpertGroups.of``
        sorts them. Returns the pairs' rows (int64 [T * k]), their weights ([T * k]) and the spans
        (int64 [experts with pairs, 3]: expert, start, count)."""
        assert expert_ids.dtype == torch.int64 and expert_ids.is_contiguous() and weights.is_contiguous()
        assert expert_ids.shape == weights.shape and expert_ids.dim() == 2
        rows, top_k = expert_ids.shape
        tokens = torch.empty(rows * top_k, dtype=torch.int64)
        w_sorted = torch.empty(rows * top_k, dtype=weights.dtype)
        spans = torch.empty((min(num_experts, rows * top_k), 3), dtype=torch.int64)
        n_spans = ctypes.c_int64()
        status = self._moe_group(
            expert_ids.data_ptr(), weights.data_ptr(), rows, top_k, num_experts, tokens.data_ptr(),
            w_sorted.data_ptr(), spans.data_ptr(), ctypes.byref(n_spans), DTYPE_CODES[weights.dtype],
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"moe_group failed: {status_text(status)}")
        return tokens, w_sorted, spans[: n_spans.value]


@functools.cache
def quant_row_bytes(type: int, k: int) -> int:
    """Bytes of one row of k weights in blocks of ggml type ``type`` (either layout, any activations)."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type & ~(X8 | A8))]
    return k // block * block_bytes
