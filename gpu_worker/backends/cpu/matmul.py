"""Which matmul runs a Linear on this CPU, by CPU kind, dtype and row count.

A decode step of few rows only streams the weights (memory-bound), a prefill
chunk or a batch of many rows reuses each weight many times (compute-bound), and
CPU kinds differ in what they do fast. Three paths exist:

- ``c``: our C few-row matmul (kernels.py) over the plain [out, in] bf16 weights,
  widened to fp32 in registers on AVX2 (half the bytes of fp32 weights), dot
  products by vdpbf16ps on AVX-512 BF16. It starts at once, where oneDNN's
  per-call start-up is a large share of a small matrix's time (docs/benchmarks-history.md).
- ``onednn``: oneDNN's matmul on weights packed once in its blocked layout, in
  the model's dtype. bf16 packing needs AVX-512 BW/VL/DQ (torch refuses it on
  AVX2), so AVX2 never takes it for bf16.
- ``onednn_fp32``: for a bf16 model, oneDNN fp32 on an fp32 packed copy of the
  weights (bf16 x bf16 products are exact in fp32; only the summation order
  differs, then one rounding to bf16): where the CPU's fp32 kernels outrun its
  bf16 ones.

``PLANS`` is measured once per CPU kind by ``python -m bench.matmul_paths`` and
committed here, never timed at start (a busy machine would change the choice,
and with it the summation order). Its comments quote the bench's numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.backends.cpu.kernels import CpuKernels
from gpu_worker.backends.cpu.kind import CpuKind


@dataclass(frozen=True)
class MatmulPlan:
    """The path of a bf16 Linear per row count: ``c`` up to ``c_max_rows`` rows (0: never), then
    ``onednn_fp32`` from ``fp32_min_rows`` rows (None: never), ``onednn`` bf16 in between."""

    c_max_rows: int
    fp32_min_rows: int | None

    def __post_init__(self) -> None:
        assert self.fp32_min_rows is None or self.fp32_min_rows > self.c_max_rows, "paths overlap"


# bf16 models, per kind, from `python -m bench.matmul_paths` on each (its numbers in docs/benchmarks.md,
# "What decides each matmul path"):
PLANS: dict[CpuKind, MatmulPlan] = {
    # Zen 5: the C gemv at 1 row is faster than oneDNN; oneDNN bf16 beat its fp32 at every count.
    CpuKind.AVX512_BF16: MatmulPlan(c_max_rows=1, fp32_min_rows=None),
    # AMX: oneDNN's bf16 matmul takes the tiles from 2 rows (its brgemm); the C gemv at 1 row as on
    # Zen 5. Not yet measured on an AMX CPU: `python -m bench.matmul_paths` on one decides.
    CpuKind.AMX: MatmulPlan(c_max_rows=1, fp32_min_rows=None),
    # Xeon without BF16 or AMX: oneDNN bf16 is emulated, slower than its fp32 from 16 rows; below 16
    # rows the weights' bytes decide, which the C kernel (the AVX2 build) halves against fp32 as on
    # AVX2. Rows 1-15 inferred, not measured: `python -m bench.matmul_paths` on such a CPU decides.
    CpuKind.AVX512: MatmulPlan(c_max_rows=8, fp32_min_rows=16),
    CpuKind.AVX512_VNNI: MatmulPlan(c_max_rows=8, fp32_min_rows=16),  # (VNNI adds nothing to bf16)
    # AVX2 (no oneDNN bf16 there): the C kernel through 48 rows, oneDNN fp32 from 49, where they
    # crossed on an EPYC Zen 3.
    CpuKind.AVX2: MatmulPlan(c_max_rows=48, fp32_min_rows=49),
    # Portable: whatever torch does, in fp32 (bf16 matmuls are emulated element by element).
    CpuKind.PORTABLE: MatmulPlan(c_max_rows=0, fp32_min_rows=1),
}


def can_pack(dtype: torch.dtype, kind: CpuKind) -> bool:
    """oneDNN's blocked weights: float32 anywhere, bfloat16 from AVX-512 on, in builds with mkldnn."""
    usable = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    return usable and (dtype == torch.float32 or (dtype == torch.bfloat16 and kind.includes(CpuKind.AVX512)))


def onednn_blocked(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in oneDNN's blocked layout, for ``onednn_linear``."""
    # The row-count hint picks the blocking; 32 suits decode batches, any count still works.
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 32)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias) with ``weight`` from ``onednn_blocked``."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class CpuLinear:
    """One Linear's weights in the layouts its paths read, and the path per row count.

    ``plain`` ([out, in] bf16) feeds the C kernel; ``packed`` is the oneDNN layout in
    the model's dtype; ``fp32`` a packed float32 copy for bf16 models. Only the
    copies some row count uses are kept.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        kind: CpuKind,
        kernels: CpuKernels | None,
    ) -> None:
        dtype = weight.dtype
        self.out_features = weight.shape[0]
        plan = PLANS[kind] if dtype == torch.bfloat16 else MatmulPlan(c_max_rows=0, fp32_min_rows=None)
        self.c_max_rows = plan.c_max_rows if kernels is not None else 0
        self.fp32_min_rows = plan.fp32_min_rows if can_pack(torch.float32, kind) else None
        if self.fp32_min_rows is not None and not can_pack(torch.bfloat16, kind):
            self.fp32_min_rows = self.c_max_rows + 1  # no oneDNN bf16 here: fp32 right after C
        in_between = self.fp32_min_rows is None or self.fp32_min_rows > self.c_max_rows + 1
        self.kernels = kernels
        self.bias = None if bias is None else bias.detach()
        self.plain = weight.detach().contiguous() if self.c_max_rows > 0 else None
        self.packed = onednn_blocked(weight) if in_between and can_pack(dtype, kind) else None
        self.unpacked = weight.detach() if in_between and self.packed is None else None
        self.fp32 = onednn_blocked(weight.float()) if self.fp32_min_rows is not None else None
        self.fp32_bias = None if bias is None or self.fp32 is None else bias.detach().float()

    def tensors(self) -> list[torch.Tensor]:
        """The copies this Linear holds (for the worker's count of weight bytes)."""
        held = (self.plain, self.packed, self.unpacked, self.fp32, self.bias, self.fp32_bias)
        return [t for t in held if t is not None]

    @property
    def paths(self) -> dict[str, bool]:
        """Which paths this Linear can take (for logs and tests)."""
        return {
            "c": self.plain is not None,
            "onednn": self.packed is not None,
            "onednn_fp32": self.fp32 is not None,
            "torch": self.unpacked is not None,
        }

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, None)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + x W^T + b`` with one rounding where the path fuses the add."""
        return self._matmul(x, residual)

    def _matmul(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0]
        if rows == 0:  # a batch none of whose rows samples has no logits to compute
            return x.new_empty((0, self.out_features))
        if rows <= self.c_max_rows:
            assert self.kernels is not None and self.plain is not None
            x = x if x.stride(-1) == 1 else x.contiguous()
            return self.kernels.matmul(x, self.plain, self.bias, residual)
        if self.fp32_min_rows is not None and rows >= self.fp32_min_rows:
            assert self.fp32 is not None
            out = onednn_linear(x.to(torch.float32), self.fp32, self.fp32_bias).to(x.dtype)
            return out if residual is None else residual + out
        if self.packed is not None:
            if residual is None:
                return onednn_linear(x, self.packed, self.bias)
            # The add as the matmul's post-op: one op, one rounding of the sum.
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")
        assert self.unpacked is not None, "a row count no path takes"
        out = F.linear(x, self.unpacked, self.bias)
        return out if residual is None else residual + out
