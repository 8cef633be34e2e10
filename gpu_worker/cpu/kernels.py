"""The worker's C kernels for CPU (csrc/*.c): attention of decode rows over the paged KV, the dense
layers' small ops (RMSNorm, rotary, silu * up) in one call each, the few-row bf16 matmul of decode
steps, the greedy argmax, and the matmul and row lookup of GGUF weights kept in their quantized
blocks (quant*.c: activations quantized to int8 per block, integer dot products, as llama.cpp).

Why C: torch has no paged attention on CPU. Its SDPA wants each decode row's KV
gathered into a padded copy first. The kernel walks each row's pages in place
instead, every row at its own length (no padding), prefetching the scattered
pages ahead of use, scoring 16 positions per step in vector registers (two
8-lane vectors on AVX2, one on AVX-512). The small ops replace 2-8 torch dispatches each (~5 us apiece)
with one call, reproducing the torch code's roundings (bf16: bit-equal). The
matmul streams plain [out, in] bf16 weights, widened to fp32 in registers where
the CPU has no bf16 dot product: decode is bound by memory, so half the bytes of
fp32 weights is most of the speed.

One library per CPU kind (kind.py), built with the system C compiler on first
use into the rivulet cache folder, with that kind's -march (x86-64-v3 for AVX2,
never -march=native: a Zen 5 with AVX-512 disabled still has AVX-VNNI, and such
a build is no AVX2 build). The name is keyed by the sources, flags and compiler.
No compiler, or a failed build: ``load()`` returns None, the reason is logged
once, and the worker keeps its torch paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import torch

from gpu_worker.cpu.kind import CpuKind, is_x86
from gpu_worker.model_files import cache_root

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = (
    "attention.c", "matmul.c", "small_ops.c", "quant.c", "quant_dense.c", "quant_legacy.c", "quant_k.c",
    "decode_layers.c",
)  # fmt: skip
HEADERS = ("common.h", "quant.h")
# -std=c11 alone turns FMA contraction off, and trapping math keeps float selects as branches: both
# leave the inner loops scalar. The kernels read no FP exception flags and no errno.
CFLAGS = (
    "-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11",
    "-ffp-contract=fast", "-fno-trapping-math", "-fno-math-errno",
)  # fmt: skip
# Per kind: the -march it is built with and the ISA code the build must report (csrc/common.h).
# AVX-512 without BF16 runs the AVX2 build: its bf16 gain is vdpbf16ps, which it lacks, and the
# fp32 paths are bound by memory (decode) or left to oneDNN, which uses AVX-512 itself (prefill).
ISA_PORTABLE, ISA_AVX2, ISA_AVX512_BF16 = 0, 1, 2
BUILDS: dict[CpuKind, tuple[tuple[str, ...], int]] = {
    CpuKind.PORTABLE: (("-march=x86-64",), ISA_PORTABLE),
    CpuKind.AVX2: (("-march=x86-64-v3",), ISA_AVX2),
    CpuKind.AVX512: (("-march=x86-64-v3",), ISA_AVX2),
    CpuKind.AVX512_BF16: (("-march=x86-64-v4", "-mavx512bf16"), ISA_AVX512_BF16),
}
BUILD_TIMEOUT_S = 120
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
MAX_HEADS, MAX_HEAD_DIM = 64, 256  # csrc's limits; larger shapes use torch


class DecodeRows(NamedTuple):
    """Decode rows as the attention kernel reads them: pointers to int64 tensors, and sizes."""

    q_rows: int
    slots: int
    kv_lens: int
    page_table: int
    pt_stride: int
    rows: int
    page_size: int
    tensors: tuple[torch.Tensor, ...]  # what the pointers point into, kept alive with them


class CpuKernels:
    """ctypes bindings of a built library; every method takes CPU tensors."""

    def __init__(self, path: Path, kind: CpuKind) -> None:
        lib = ctypes.CDLL(str(path))
        self.path = path
        self.kind = kind
        self.isa = int(lib.kernel_isa())
        expected = BUILDS[kind][1] if is_x86() else ISA_PORTABLE
        if self.isa != expected:
            raise RuntimeError(f"kernels for {kind.value} built as ISA {self.isa}, not {expected}")
        self._attention = lib.paged_decode_attention
        self._attention.restype = ctypes.c_int
        self._attention.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
        ]  # fmt: skip

        i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
        self._rms_norm = lib.rms_norm
        self._rms_norm.argtypes = [ptr, i64, ptr, ptr, i64, i32, f32, i32]
        self._rotary = lib.rotary
        self._rotary.argtypes = [ptr, i64, i64, i32, i32, ptr, ptr, i32]
        self._silu_mul = lib.silu_mul
        self._silu_mul.argtypes = [ptr, ptr, i64, i32, i32]
        self._matmul = lib.matmul_bf16
        self._matmul.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, i32, i32, i32]
        self._argmax = lib.argmax_rows
        self._argmax.argtypes = [ptr, i64, i64, i32, i32, ptr]
        for fn in (self._rms_norm, self._rotary, self._silu_mul, self._matmul, self._argmax):
            fn.restype = None
        self._quant_supported = lib.quant_supported
        self._quant_supported.argtypes = [i32]
        self._quant_supported.restype = i32
        self._quant_act_row_bytes = lib.quant_act_row_bytes
        self._quant_act_row_bytes.argtypes = [i32, i64]
        self._quant_act_row_bytes.restype = i64
        self._quant_matmul = lib.quant_matmul
        self._quant_matmul.argtypes = [i32, ptr, i64, i64, ptr, i64, i32, i64, ptr, ptr, i32, ptr, i64]
        self._quant_matmul.restype = i32
        self._quant_matmul_dense = lib.quant_matmul_dense
        self._quant_matmul_dense.argtypes = [i32, ptr, i64, i64, ptr, i64, i32, i64, ptr, i32, ptr, i64]
        self._quant_matmul_dense.restype = i32
        self._decode_layers = lib.decode_layers
        self._decode_layers.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64]
        self._decode_layers.restype = i32
        self._quant_get_rows = lib.quant_get_rows
        self._quant_get_rows.argtypes = [i32, ptr, i64, ptr, i64, ptr, i32]
        self._quant_get_rows.restype = None
        self._local = threading.local()
        self._act_row_bytes = functools.cache(lambda type, k: int(self._quant_act_row_bytes(type, k)))

    @staticmethod
    def supports(num_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
        """Whether ``decode_attention`` takes a model of these head shapes in this dtype."""
        return (
            dtype in DTYPE_CODES
            and num_heads % kv_heads == 0
            and num_heads <= MAX_HEADS
            and head_dim <= MAX_HEAD_DIM
        )

    def decode_rows(
        self,
        q_rows: torch.Tensor,
        slots: torch.Tensor,
        kv_lens: torch.Tensor,
        page_table: torch.Tensor,
        page_size: int,
    ) -> DecodeRows:
        """The raw arguments for ``attend`` of decode rows: checked once, used by every layer.
        Row i reads q row q_rows[i] and attends positions [0, kv_lens[i]) of request slot
        slots[i] through ``page_table``."""
        assert page_table.is_contiguous() and page_table.dtype == torch.int64
        for t in (q_rows, slots, kv_lens):
            assert t.dtype == torch.int64 and t.is_contiguous() and len(t) == len(q_rows)
        return DecodeRows(
            q_rows.data_ptr(), slots.data_ptr(), kv_lens.data_ptr(), page_table.data_ptr(),
            page_table.shape[1], len(q_rows), page_size, (q_rows, slots, kv_lens, page_table),
        )  # fmt: skip

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        rows: DecodeRows,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """out[q_rows[i]] = softmax(q[q_rows[i]] K^T / sqrt(D)) V for each of ``rows``; q, out:
        [T, Hq, D]; caches [N, Hkv, D] (contiguous). ``new_kv``: k, v [T, Hkv, D] (heads contiguous)
        of which row i's K/V (row q_rows[i]) are first written at its last position."""
        _, heads, head_dim = q.shape
        assert q.stride(2) == 1 and q.stride(1) == head_dim, "q: heads and head_dim must be contiguous"
        k_ptr = v_ptr = k_stride = v_stride = 0
        if new_kv is not None:
            k, v = new_kv
            k_ptr, v_ptr, k_stride, v_stride = k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0)
        status = self._attention(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
            DTYPE_CODES[q.dtype], rows.q_rows, rows.slots, rows.kv_lens, rows.page_table, rows.pt_stride,
            rows.rows, heads, k_cache.shape[1], head_dim, rows.page_size, head_dim**-0.5,
            k_ptr, k_stride, v_ptr, v_stride,
        )  # fmt: skip
        assert status == 0, (
            f"paged_decode_attention refused heads {heads}/{k_cache.shape[1]}, head_dim {head_dim}"
        )

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        q_rows: torch.Tensor,
        slots: torch.Tensor,
        kv_lens: torch.Tensor,
        page_table: torch.Tensor,
        page_size: int,
    ) -> None:
        """``attend`` in one call, for one-off use (tests)."""
        assert out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
        self.attend(q, k_cache, v_cache, out, self.decode_rows(q_rows, slots, kv_lens, page_table, page_size))

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
        """Rotate heads [0, heads) of x [T, H, D] in place; cos / signed_sin [T, 1, D] contiguous."""
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

    # GGUF weights in their quantized blocks (csrc/quant.h): ``type`` is ggml's type id
    # (gguf.GGMLQuantizationType), ``w`` the [n, row bytes] uint8 blocks as the file holds them.

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
        32 (csrc/quant.h), or with ``dense`` meet W dequantized to float32 (csrc/quant_dense.c); sums
        in float32, one rounding at the end. x and residual rows may be strided (last dim
        contiguous); residual [M, N] in x's dtype."""
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
    ) -> torch.Tensor:
        """``quant_matmul`` for blocks ``quant_check`` passed (it returned ``act_bytes``): what a
        Linear calls per step, with only the checks that depend on x. ``dense``: the many-row path
        (csrc/quant_dense.c), W dequantized panel by panel and x not quantized."""
        assert x.dim() == 2 and x.shape[1] == k and x.stride(1) == 1, "x: [M, k], rows contiguous"
        m, n = x.shape[0], w.shape[0]
        out = torch.empty((m, n), dtype=x.dtype)
        if residual is not None:
            assert residual.shape == (m, n) and residual.dtype == x.dtype and residual.stride(1) == 1
        res = (None, 0) if residual is None else (residual.data_ptr(), residual.stride(0))
        head = (type, w.data_ptr(), n, k, x.data_ptr(), x.stride(0), DTYPE_CODES[x.dtype], m)
        if dense:
            status = self._quant_matmul_dense(*head, out.data_ptr(), DTYPE_CODES[x.dtype], *res)
        else:
            scratch = self._scratch(m * act_bytes)
            status = self._quant_matmul(*head, scratch.data_ptr(), out.data_ptr(), DTYPE_CODES[x.dtype], *res)
        if status != 0:
            raise ValueError(f"quant_matmul refused type {type}, k={k}, dtype {x.dtype}: status {status}")
        return out

    def _scratch(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` for quantized activations, reused by this thread's calls
        (an allocation per call costs about as much as a small matmul's compute)."""
        buf: torch.Tensor | None = getattr(self._local, "scratch", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._local.scratch = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
        return buf

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
        structs are gpu_worker/cpu/decode_layers.py's): out [T, hidden] from the embedding rows x,
        cos / sin [T, 1, head_dim] at the rows' positions, the attention's ``rows``."""
        status = self._decode_layers(
            ctypes.byref(layers), n_layers, ctypes.byref(dims), x.data_ptr(), out.data_ptr(), rows.rows,
            cos.data_ptr(), sin.data_ptr(), rows.q_rows, rows.slots, rows.kv_lens, rows.page_table,
            rows.pt_stride, rows.page_size,
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"decode_layers failed: status {status}")

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
def quant_row_bytes(type: int, k: int) -> int:
    """Bytes of one row of k weights in blocks of ggml type ``type``."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type)]
    return k // block * block_bytes


@functools.cache
def load(kind: CpuKind) -> CpuKernels | None:
    """The kernels for ``kind``, built on first use; None (logged once) where they cannot be."""
    try:
        return CpuKernels(build(kind), kind)
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        logger.warning("CPU kernels unavailable, using torch paths: %s", exc)
        return None


def build(kind: CpuKind) -> Path:
    """Path of the library for ``kind``, compiling it unless these sources/flags/compiler have one."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    flags = CFLAGS + (BUILDS[kind][0] if is_x86() else ())
    texts = [(CSRC / name).read_text() for name in SOURCES + HEADERS]
    key = hashlib.sha256("\n".join([*texts, " ".join(flags), version]).encode()).hexdigest()[:16]
    out_dir = cache_root() / "kernels"
    target = out_dir / f"cpu_kernels-{kind.value}-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a concurrent builder never sees half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        sources = [str(CSRC / name) for name in SOURCES]
        done = subprocess.run(
            [compiler, *flags, "-o", tmp, *sources, "-lm"],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built CPU kernels for %s: %s", kind.value, target)
    return target
