"""Small building blocks shared by our model files.

Parameters are created with ``torch.empty`` (no random init: the loader
overwrites every one of them), so building a model costs only its allocation.
Each block mirrors the op order of the HF reference where that order decides
rounding, so float64 runs can be compared with HF to ~1e-12.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from gpu_worker.cpu.kernels import CpuKernels

# Rows from which a bf16 Linear with an fp32 copy runs its matmul in fp32 (see pack_linear_weights).
# Measured per layer of SmolLM2 on the 2-core Xeon without AMX: bf16 wins up to 8 rows (memory
# bound: half the bytes), fp32 from 16 (0.70 vs 0.83 ms at 16 rows, 8.0 vs 12.2 ms at 256).
FP32_MIN_ROWS = 16


class Linear(nn.Module):
    """``y = x W^T + b`` with HF's [out, in] weight layout.

    After ``pack_linear_weights`` the weight is a oneDNN-blocked (mkldnn) tensor
    and the matmul goes straight to oneDNN with it. A bf16 Linear may also hold
    an fp32 blocked copy (``fp32_weight``) for matmuls of many rows, where this
    CPU's fp32 kernels outrun its bf16 ones.
    """

    fp32_weight: torch.Tensor | None = None
    fp32_bias: torch.Tensor | None = None
    # The runner's C kernels and the weight as loaded ([out, in] bf16, not packed): a one-row
    # matmul goes to kernels.gemv, which streams it faster than oneDNN starts up on it.
    kernels: CpuKernels | None = None
    plain_weight: torch.Tensor | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def _one_row(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """The C one-row matmul's ``residual + x W^T + b`` where it applies, else None."""
        if self.kernels is None or self.plain_weight is None or x.shape[0] != 1 or not x.is_contiguous():
            return None
        return self.kernels.matmul(
            x, self.plain_weight, self.bias, None if residual is None else residual.contiguous()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (out := self._one_row(x)) is not None:
            return out
        if self.fp32_weight is not None and x.shape[0] >= FP32_MIN_ROWS:
            # bf16 x bf16 products are exact in fp32 and oneDNN's bf16 kernels accumulate in
            # fp32 too: only the summation order differs, then one rounding to bf16 as before.
            out = _blocked_linear(x.to(torch.float32), self.fp32_weight, self.fp32_bias)
            return out.to(x.dtype)
        if self.weight.is_mkldnn:
            return _blocked_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``. On oneDNN-packed weights the add is the matmul's post-op: one op,
        and one rounding of the sum instead of two (closer to the exact sum than the reference)."""
        if (out := self._one_row(x, residual)) is not None:
            return out
        if self.weight.is_mkldnn and (self.fp32_weight is None or x.shape[0] < FP32_MIN_ROWS):
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")
        return residual + self(x)


def _blocked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def pin_attributes(model: nn.Module) -> None:
    """Put every module's submodules, parameters and buffers in its instance ``__dict__``.

    nn.Module keeps them in side tables reached through ``__getattr__``, a Python call per
    lookup (~0.45 us, against ~0.04 from the instance dict). A decode step looks up ~30 per
    layer: ~0.4 ms of a ~9 ms one-row step. Reassigning one later stays correct: nn.Module's
    ``__setattr__`` drops the instance-dict entry before it registers the new value.
    """
    for module in model.modules():
        for table in (module._modules, module._parameters, module._buffers):
            for name, value in table.items():
                if value is not None:
                    module.__dict__[name] = value


def can_pack_linear_weights(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's blocked weights exist for CPU float32/bfloat16 in builds with mkldnn."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def _blocked(weight: torch.Tensor) -> torch.Tensor:
    # The row-count hint picks the blocking; 32 suits decode batches, any count still works.
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)


def pack_linear_weights(model: nn.Module) -> int:
    """Reorder every Linear's weight once into oneDNN's blocked layout; return how many.

    Measured on this project's 2-core CPU (SmolLM2 shapes, 1 thread): bf16
    matmuls 1.45x faster at 1 row, 1.15x at 32; float32 1.7x at 8 rows, even at
    1. A head tied to the embedding gets its own packed copy (the embedding
    keeps the plain table). Results equal F.linear's bit for bit in bf16.

    bf16 layers (not the head) also get an fp32 blocked copy when fp32 matmuls
    measure faster here (``fp32_matmul_pays``): on a Xeon without AMX, 1.5x at
    32 to 256 rows. It costs 4 more bytes per layer weight; the head is left
    out (its 32-row matmul was no faster in fp32).
    """
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]
    bf16 = [m for name, m in linears if m.weight.dtype == torch.bfloat16 and name != "lm_head"]
    with_fp32 = bool(bf16) and fp32_matmul_pays(max(bf16, key=lambda m: m.weight.numel()).weight)
    packed = 0
    for _, module in linears:
        if module.weight.is_mkldnn:
            continue
        if module.weight.dtype == torch.bfloat16:  # for Linear.plain_weight; the runner drops unused ones
            module.plain_weight = module.weight.detach()
        if with_fp32 and any(module is m for m in bf16):
            module.fp32_weight = _blocked(module.weight.float())
            module.fp32_bias = None if module.bias is None else module.bias.detach().float()
        module.weight = nn.Parameter(_blocked(module.weight), requires_grad=False)
        packed += 1
    return packed


def fp32_matmul_pays(weight: torch.Tensor, rows: int = 64, reps: int = 5) -> bool:
    """Whether this CPU multiplies ``rows`` rows by the bf16 ``weight`` clearly faster in fp32.

    Measured, not inferred from CPU flags: without AMX a Xeon's fp32 kernels run
    ~185 GFLOP/s and its bf16 ones ~110, while Zen 5 is the other way round.
    Best of ``reps`` each, so a busy neighbour rarely flips the answer (and a
    flipped answer only costs speed, not results).
    """
    x = torch.randn(rows, weight.shape[1]).to(torch.bfloat16)
    w16, w32 = _blocked(weight), _blocked(weight.float())
    bf16_s = _best_time_s(lambda: _blocked_linear(x, w16, None), reps)
    fp32_s = _best_time_s(lambda: _blocked_linear(x.float(), w32, None).to(torch.bfloat16), reps)
    return fp32_s < 0.8 * bf16_s


def _best_time_s(fn: Callable[[], torch.Tensor], reps: int) -> float:
    fn()  # oneDNN builds its kernel on the first call
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


class MergedLinear(Linear):
    """Several projections of one input in a single matmul (q/k/v, or gate/up).

    ``shards`` names the checkpoint's separate projections (siblings of this
    module, e.g. ``q_proj``) and the block of output rows each one fills, in
    order; the loader copies each checkpoint weight into its block.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shards.values()), bias)
        starts = [0]
        for rows in shards.values():
            starts.append(starts[-1] + rows)
        self.shards = {
            name: (start, rows) for (name, rows), start in zip(shards.items(), starts, strict=False)
        }
        self.sizes = list(shards.values())


class Conv1D(nn.Module):
    """GPT-2's projection: weight stored [in, out], ``y = b + x W``."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x, self.weight)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm whose statistics are taken in float32, as HF does for every model dtype.

    (For bf16 this is the accurate choice; for float64 it matches the reference bit for bit.)
    ``kernels`` (set by the runner on CPU): one C call for [T, dim] rows, bit-equal in bf16.
    """

    kernels: CpuKernels | None = None

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.dim() == 2 and x.stride(1) == 1:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        # torch's one call takes the reference's steps in the same order (equal bit for bit over
        # random SmolLM2-sized rows, float32 and bf16 inputs): 8 ops -> 4 for bf16, 31 -> 20 us
        # at 1 row in float32.
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.to(torch.float32), self.weight.shape, None, self.eps).to(x.dtype)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh GELU, written as the reference writes it."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation an HF config names (``hidden_act`` / ``activation_function``)."""
    match name:
        case "silu" | "swish":
            return F.silu
        case "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast":
            return gelu_new
        case "gelu":
            return F.gelu
        case "relu":
            return F.relu
        case _:
            raise NotImplementedError(f"activation {name!r} is not supported")


class RotaryCache(nn.Module):
    """cos/sin of every position up to ``context_len``, looked up per token.

    Angles are computed in float32 and then cast, as HF does, so every model
    dtype sees the same angles as the reference. ``sin`` is stored with its
    first half negated (see ``apply_rotary``).
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, inv_freq: torch.Tensor, scaling: float, context_len: int) -> None:
        super().__init__()
        positions = torch.arange(context_len, dtype=torch.float32)  # on the default (model) device
        freqs = positions[:, None] * inv_freq.to(positions.device, torch.float32)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        signs = torch.cat((-torch.ones_like(freqs[0]), torch.ones_like(freqs[0])))
        dtype = torch.get_default_dtype()
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype) * signs.to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> cos, signed sin of shape [T, 1, head_dim] (broadcast over heads)."""
        # index_select, not cos[positions]: advanced indexing is several times slower on CPU.
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(
            0, positions
        ).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, head_dim] by the half-split (NeoX/HF) convention.

    HF computes ``x * cos + cat(-x2, x1) * sin``. With the sign folded into
    ``signed_sin`` the swap is one flip and no negation, and the products are
    the same numbers (negation is exact), so every dtype matches HF bit for
    bit: 4 ops and 2 temporaries instead of 6 and 5.
    """
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # cat(x2, x1)
    out = x * cos
    out += swapped.mul_(signed_sin)
    return out
