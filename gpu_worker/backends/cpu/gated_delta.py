"""The C kernels of Gated DeltaNet layers (csrc/gated_delta.c): the gated delta rule over a pool of
float32 recurrent states, one decode token or a chunked prefill per row, and the causal depthwise
conv1d in front of it over a pool of conv states.

Shapes (N tokens of B rows, rows packed one after another; ``Hk`` key heads, ``Hv`` value heads,
each key head serving Hv / Hk consecutive value heads; activations float32 or bfloat16, one dtype):

    decode(q, k, v, g, beta, state, slots, *, fresh=None, l2norm=True, scale=None, tiled=False) -> out
        q, k [B, Hk, Dk]; v [B, Hv, Dv]; g, beta [B, Hv]; one token per row      -> out [B, Hv, Dv]
    prefill(q, k, v, g, beta, state, slots, cu_seqlens, *, fresh=None, l2norm=True, scale=None,
            tiled=False) -> out
        q, k [N, Hk, Dk]; v [N, Hv, Dv]; g, beta [N, Hv]; row i's tokens
        [cu_seqlens[i], cu_seqlens[i + 1])                                       -> out [N, Hv, Dv]
    conv1d(x, weight, conv_state, slots, cu_seqlens, *, bias=None, silu=True, fresh=None) -> out
        x [N, C]; weight [C, K] (HF's conv1d weight without its middle dim)     -> out [N, C]
    decode_step(parts, params, pools, slots, eps, k_heads, tiled) -> out [B, Hv Dv]
        a float32 decode step's whole layer between its projections: the conv1d and SiLU, the
        gates, the rule and the gated RMSNorm in one call (its docstring)

- ``state`` [S, Hv, Dk, Dv] float32, contiguous: row i's state is ``state[slots[i]]`` (int64 [B]),
  read as the initial state and overwritten with the final one. ``fresh`` (bool [B]): rows that
  start from zeros instead (their slot's old contents are ignored and overwritten).
- q, k, v, x: rows may be strided (views of a projection's output), each row's heads contiguous;
  g, beta: float32 or bfloat16 each (HF: g float32, beta the activations' dtype), rows strided.
- ``tiled``: value head h reads key head h % Hk (a checkpoint whose value heads are tiled over the key
  heads) instead of h // (Hv / Hk).
- ``l2norm``: q and k are L2-normed in float32 first (HF's ``use_qk_l2norm_in_kernel``); then q is
  scaled by ``scale`` (default Dk ** -0.5, as HF always does). ``l2norm=False, scale=1.0`` takes q
  and k as given.
- ``conv_state`` [S, C, W] float32 or bfloat16, W >= K - 1: the last W inputs of the row (HF keeps
  W = K), read for the first outputs and updated in place. ``silu``: SiLU after the conv, each of
  the two results rounded to the dtype as torch's two ops do.

Math is float32 (out rounded to the activations' dtype once); decode and prefill agree with the
token-by-token recurrence to float32 rounding.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch

from gpu_worker.backends.cpu import abi
from gpu_worker.backends.cpu.build import DTYPE_CODES

MAX_HEAD_DIM = 256  # the widest head its tests cover (csrc/rivulet_kernels.h bounds the C at 512)
MAX_CONV_KERNEL = 8  # csrc/gated_delta.c's


class GatedDeltaKernels:
    """ctypes bindings of gated_delta.c in a built kernels library (every method takes CPU tensors)."""

    tiled_heads = True  # decode and prefill take ``tiled`` (models/gated_delta_pooled.py's PooledRule)

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
        # q, k, v with their strides and dtype, g and beta with theirs, state, slots, fresh
        rule: list[Any] = [ptr, i64, ptr, i64, ptr, i64, i32, ptr, i64, i32, ptr, i64, i32, ptr, ptr, ptr]
        self._decode = lib.gated_delta_decode
        self._decode.argtypes = [*rule, ptr, i64, i32, i32, i32, i32, i32, i32, f32]
        self._prefill = lib.gated_delta_prefill
        self._prefill.argtypes = [*rule, ptr, i64, ptr, i32, i32, i32, i32, i32, i32, f32]
        self._conv1d = lib.causal_conv1d
        self._conv1d.argtypes = [
            ptr, i64, i32, ptr, ptr, i32, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i32, i32,
        ]  # fmt: skip
        self._step = lib.gated_delta_decode_step
        self._step.argtypes = [
            ptr, i64, ptr, i64, ptr, i64, ptr, i64, ptr, i32, ptr, i64, ptr, i64, ptr, i64, ptr, ptr,
            ptr, f32, i32, i32, i32, i32, i32, f32, ptr, ptr,
        ]  # fmt: skip
        for fn in (self._decode, self._prefill, self._conv1d, self._step):
            fn.restype = ctypes.c_int
        abi.check(abi.bound_functions(self), {}, {})

    def decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
        *,
        fresh: torch.Tensor | None = None,
        l2norm: bool = True,
        scale: float | None = None,
        tiled: bool = False,
    ) -> torch.Tensor:
        """One token per row through the rule (module docstring); state[slots] advanced in place."""
        rows = q.shape[0]
        _check_rule(q, k, v, g, beta, state, slots, fresh, rows)
        out = torch.empty((rows, v.shape[1], v.shape[2]), dtype=q.dtype)
        status = self._decode(
            *_rule_args(q, k, v, g, beta, state, slots, fresh), out.data_ptr(), rows, k.shape[1], v.shape[1],
            k.shape[2], v.shape[2], int(tiled), int(l2norm), k.shape[2] ** -0.5 if scale is None else scale,
        )  # fmt: skip
        assert status == 0, f"gated_delta_decode refused: {abi.status_text(status)}"
        return out

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
        cu_seqlens: torch.Tensor,
        *,
        fresh: torch.Tensor | None = None,
        l2norm: bool = True,
        scale: float | None = None,
        tiled: bool = False,
    ) -> torch.Tensor:
        """Each row's tokens through the chunked rule (module docstring); state[slots] advanced."""
        seqs = _check_cu_seqlens(cu_seqlens, q.shape[0])
        _check_rule(q, k, v, g, beta, state, slots, fresh, seqs)
        out = torch.empty((q.shape[0], v.shape[1], v.shape[2]), dtype=q.dtype)
        status = self._prefill(
            *_rule_args(q, k, v, g, beta, state, slots, fresh), cu_seqlens.data_ptr(), seqs, out.data_ptr(),
            k.shape[1], v.shape[1], k.shape[2], v.shape[2], int(tiled), int(l2norm),
            k.shape[2] ** -0.5 if scale is None else scale,
        )  # fmt: skip
        assert status == 0, f"gated_delta_prefill refused: {abi.status_text(status)}"
        return out

    def conv1d(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        conv_state: torch.Tensor,
        slots: torch.Tensor,
        cu_seqlens: torch.Tensor,
        *,
        bias: torch.Tensor | None = None,
        silu: bool = True,
        fresh: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The causal depthwise conv1d of each row's tokens (module docstring); conv_state[slots] updated."""
        seqs = _check_cu_seqlens(cu_seqlens, x.shape[0])
        _check_conv(x, weight, bias, conv_state)
        _check_slots(slots, fresh, seqs, conv_state.shape[0])
        (channels, kernel), width = weight.shape, conv_state.shape[2]
        out = torch.empty((x.shape[0], channels), dtype=x.dtype)
        status = self._conv1d(
            x.data_ptr(), x.stride(0), DTYPE_CODES[x.dtype], out.data_ptr(), conv_state.data_ptr(),
            DTYPE_CODES[conv_state.dtype], width, slots.data_ptr(), _ptr(fresh), cu_seqlens.data_ptr(), seqs,
            weight.data_ptr(), _ptr(bias), channels, kernel, int(silu),
        )  # fmt: skip
        assert status == 0, f"causal_conv1d refused: {abi.status_text(status)}"
        return out

    def decode_step(
        self, parts: tuple[torch.Tensor, ...], params: tuple[torch.Tensor, ...],
        pools: tuple[torch.Tensor, ...], slots: torch.Tensor, eps: float, k_heads: int, tiled: bool,
    ) -> torch.Tensor:  # fmt: skip
        """A decode step's Gated DeltaNet block between its projections, all float32, one token a row:
        ``parts`` mixed [B, C], z [B, Hv Dv], b, a [B, Hv] (rows strided, each row contiguous);
        ``params`` the conv weight [C, K], A_log, dt_bias [Hv], the gated norm's weight [Dv];
        ``pools`` the conv states [S, C, W] and recurrent states [S, Hv, Dk, Dv], advanced at ``slots``
        (int64 [B]) in place -> out [B, Hv Dv]. ``tiled``: value head h reads key head h % Hk."""
        mixed, z, b, a = parts
        weight, a_log, dt_bias, norm_w = params
        conv_state, state = pools
        rows, channels = mixed.shape
        (_, v_heads, dk, dv), kernel = state.shape, weight.shape[1]
        _check(
            all(t.dtype == torch.float32 and t.stride(-1) == 1 for t in (*parts, *params, *pools)),
            "decode_step: float32 tensors, each row contiguous",
        )
        _check(all(t.is_contiguous() for t in (*params, *pools)), "decode_step: contiguous weights and pools")
        _check(
            z.shape == (rows, v_heads * dv) and b.shape == a.shape == (rows, v_heads)
            and channels == 2 * k_heads * dk + v_heads * dv and weight.shape[0] == channels
            and conv_state.shape[:2] == (state.shape[0], channels) and norm_w.shape == (dv,)
            and a_log.shape == dt_bias.shape == (v_heads,),
            "decode_step: shapes disagree",
        )  # fmt: skip
        _check(
            slots.dtype == torch.int64 and slots.shape == (rows,) and slots.is_contiguous(),
            "slots: int64 [B]",
        )
        scratch = torch.empty((rows, channels), dtype=torch.float32)
        out = torch.empty((rows, v_heads * dv), dtype=torch.float32)
        status = self._step(
            mixed.data_ptr(), mixed.stride(0), z.data_ptr(), z.stride(0), b.data_ptr(), b.stride(0),
            a.data_ptr(), a.stride(0), weight.data_ptr(), kernel, conv_state.data_ptr(), conv_state.shape[2],
            state.data_ptr(), state.shape[0], slots.data_ptr(), rows, a_log.data_ptr(), dt_bias.data_ptr(),
            norm_w.data_ptr(), eps, k_heads, v_heads, dk, dv, int(tiled), dk**-0.5, scratch.data_ptr(),
            out.data_ptr(),
        )  # fmt: skip
        assert status == 0, f"gated_delta_decode_step refused: {abi.status_text(status)}"
        return out


class HfDeltaRule:
    """The kernels in transformers' signature of the gated delta rule, what the kernel slots of
    models/gated_delta.py's ``GatedDeltaNet`` take: q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta
    [B, T, Hv], ``initial_state`` [B, Hv, Dk, Dv] (read, never written) -> (out [B, T, Hv, Dv] in q's
    dtype, the final float32 states or None). ``chunked``: the chunked prefill (else one token per
    row, the decode step). The states go through a copy: the signature's callers own theirs."""

    def __init__(self, kernels: GatedDeltaKernels, chunked: bool) -> None:
        self.kernels, self.chunked = kernels, chunked

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows, tokens = key.shape[:2]
        q, k, v, g, beta = (t.reshape(rows * tokens, *t.shape[2:]) for t in (query, key, value, g, beta))
        if initial_state is None:
            state = torch.zeros((rows, value.shape[2], key.shape[3], value.shape[3]), dtype=torch.float32)
        else:
            state = initial_state.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        slots = torch.arange(rows)
        if self.chunked or tokens != 1:
            cu_seqlens = torch.arange(rows + 1) * tokens
            out = self.kernels.prefill(
                q, k, v, g, beta, state, slots, cu_seqlens, l2norm=use_qk_l2norm_in_kernel
            )
        else:
            out = self.kernels.decode(q, k, v, g, beta, state, slots, l2norm=use_qk_l2norm_in_kernel)
        return out.view(rows, tokens, *out.shape[1:]), state if output_final_state else None


@functools.cache
def load(path: Path) -> GatedDeltaKernels:
    """The bindings of the library at ``path`` (a CpuKernels' ``path``), bound once."""
    return GatedDeltaKernels(path)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"gated delta kernels: {message}")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check_cu_seqlens(cu_seqlens: torch.Tensor, tokens: int) -> int:
    _check(cu_seqlens.dtype == torch.int64 and cu_seqlens.dim() == 1, "cu_seqlens must be int64 [B + 1]")
    _check(cu_seqlens.is_contiguous() and len(cu_seqlens) >= 1, "cu_seqlens must be contiguous [B + 1]")
    steps = cu_seqlens.diff()
    _check(int(cu_seqlens[0]) == 0 and int(cu_seqlens[-1]) == tokens, f"cu_seqlens must run 0 .. {tokens}")
    _check(len(steps) == 0 or int(steps.min()) >= 0, "cu_seqlens must not decrease")
    return len(cu_seqlens) - 1


def _check_slots(slots: torch.Tensor, fresh: torch.Tensor | None, rows: int, pool: int) -> None:
    _check(
        slots.dtype == torch.int64 and slots.shape == (rows,) and slots.is_contiguous(), "slots: int64 [B]"
    )
    if rows:
        low, high = slots.aminmax()
        _check(0 <= int(low) and int(high) < pool, f"slots must lie in [0, {pool})")
    _check(
        fresh is None or (fresh.dtype == torch.bool and fresh.shape == (rows,) and fresh.is_contiguous()),
        "fresh: bool [B]",
    )


def _check_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor
) -> None:
    channels, kernel = weight.shape
    _check(x.dim() == 2 and x.shape[1] == channels and x.stride(1) == 1, "x must be [N, C], rows contiguous")
    _check(x.dtype in DTYPE_CODES and weight.dtype == x.dtype, "x, weight: one dtype, float32 or bfloat16")
    _check(weight.is_contiguous() and 1 <= kernel <= MAX_CONV_KERNEL, f"weight [C, K <= {MAX_CONV_KERNEL}]")
    _check(bias is None or (bias.shape == (channels,) and bias.dtype == x.dtype), "bias [C] in x's dtype")
    _check(
        conv_state.dim() == 3 and conv_state.shape[1] == channels
        and kernel - 1 <= conv_state.shape[2] <= MAX_CONV_KERNEL,
        f"conv_state must be [S, C, W] with K - 1 <= W <= {MAX_CONV_KERNEL}",
    )  # fmt: skip
    _check(
        conv_state.is_contiguous() and conv_state.dtype in DTYPE_CODES, "conv_state: contiguous f32 or bf16"
    )


def _check_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor | None,
    rows: int,
) -> None:
    """The rule's arguments as the module docstring has them, or ValueError naming the first misfit."""
    tokens, k_heads, dk = k.shape
    _, v_heads, dv = v.shape
    _check(q.shape == k.shape and v.shape[0] == tokens, "q, k must be [N, Hk, Dk] and v [N, Hv, Dv]")
    _check(v_heads % k_heads == 0, f"{v_heads} value heads are no multiple of {k_heads} key heads")
    _check(dk <= MAX_HEAD_DIM and dv <= MAX_HEAD_DIM, f"head dims above {MAX_HEAD_DIM}")
    _check(
        q.dtype in DTYPE_CODES and k.dtype == v.dtype == q.dtype, "q, k, v: one dtype, float32 or bfloat16"
    )
    for name, t, dim in (("q", q, dk), ("k", k, dk), ("v", v, dv)):
        _check(t.stride(2) == 1 and t.stride(1) == dim, f"{name}: each row's heads must be contiguous")
    for name, t in (("g", g), ("beta", beta)):
        _check(t.shape == (tokens, v_heads) and t.stride(1) == 1, f"{name} must be [N, Hv], heads contiguous")
        _check(t.dtype in DTYPE_CODES, f"{name}: float32 or bfloat16")
    _check(state.dtype == torch.float32 and state.is_contiguous(), "state must be contiguous float32")
    _check(state.dim() == 4 and state.shape[1:] == (v_heads, dk, dv), "state must be [S, Hv, Dk, Dv]")
    _check_slots(slots, fresh, rows, state.shape[0])


def _rule_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor | None,
) -> tuple[int | None, ...]:
    return (
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), DTYPE_CODES[q.dtype],
        g.data_ptr(), g.stride(0), DTYPE_CODES[g.dtype], beta.data_ptr(), beta.stride(0),
        DTYPE_CODES[beta.dtype], state.data_ptr(), slots.data_ptr(), _ptr(fresh),
    )  # fmt: skip
