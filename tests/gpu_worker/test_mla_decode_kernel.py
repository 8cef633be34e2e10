"""Latent attention's absorbed decode kernel (csrc/mla.c): every query head over one shared latent row
a position, the value the row's first v_dim values, against float64 on random paged pools: several
rows at lengths off the page size, a long row split over threads, 16 and 128 heads (DeepSeek-V2-Lite's
and V3's), every pool and query dtype the kernel takes; and the CPU backend routing a latent pool's
decode rows to it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpu_worker.backends.cpu import attention as cpu_attention
from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.forward_context import AttentionOptions
from tests.gpu_worker.test_cpu_kernels import DTYPE_IDS, DTYPES, needs_compiler

RANK, ROPE, PAGE = 512, 64, 16
LATENT = RANK + ROPE


def latent_reference(q: torch.Tensor, latents: torch.Tensor, v_dim: int, scale: float) -> torch.Tensor:
    """One row in float64: q [H, D] over latents [L, D]; each head's softmax . latents[:, :v_dim]."""
    scores = q.double() @ latents.double().T * scale
    return torch.softmax(scores, dim=-1) @ latents.double()[:, :v_dim]


def _paged_pool(lens: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A random latent pool [N, 1, D] and a shuffled page table holding one row of each length."""
    per_row = -(-max(lens) // PAGE)
    pool = torch.randn(len(lens) * per_row * PAGE, 1, LATENT).to(dtype)
    page_table = torch.randperm(len(lens) * per_row).view(len(lens), per_row).contiguous()
    return pool, page_table


def _row_latents(pool: torch.Tensor, page_table: torch.Tensor, row: int, length: int) -> torch.Tensor:
    pos = torch.arange(length)
    return pool[page_table[row, pos // PAGE] * PAGE + pos % PAGE, 0]


def _check(kernels: cpu_kernels.CpuKernels, lens: list[int], heads: int, dtypes: tuple, v_dim: int) -> None:
    q_dtype, kv_dtype = dtypes
    torch.manual_seed(len(lens) * 1000 + heads)
    pool, page_table = _paged_pool(lens, kv_dtype)
    rows = len(lens)
    q = (torch.randn(rows + 1, heads, LATENT) * 0.5).to(q_dtype)  # q row 0 attended by none
    q_rows = torch.arange(rows, 0, -1)  # row i reads q row rows - i
    out = torch.zeros(rows + 1, heads, v_dim, dtype=q_dtype)
    decode = kernels.decode_rows(q_rows, torch.arange(rows), torch.tensor(lens), page_table, PAGE)
    scale = LATENT**-0.5
    kernels.latent_attend(q, pool, out, decode, v_dim, scale)
    assert out[0].abs().max() == 0
    tolerance = 2e-5 if q_dtype == torch.float32 else 1e-2  # float32 sums; bf16's output rounding
    for i, length in enumerate(lens):
        want = latent_reference(q[int(q_rows[i])], _row_latents(pool, page_table, i, length), v_dim, scale)
        got = out[int(q_rows[i])].double()
        assert (got - want).abs().max() <= tolerance * want.abs().max(), (i, length)


@needs_compiler
@pytest.mark.cpu_kinds
@pytest.mark.parametrize("dtypes", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads", [16, 128])
def test_rows_against_float64(kernels: cpu_kernels.CpuKernels, dtypes: tuple, heads: int) -> None:
    """Rows at lengths off the page size (one past the span a task takes at least), the value the
    latent part only."""
    _check(kernels, [1, 37, 130, 300], heads, dtypes, RANK)


@needs_compiler
@pytest.mark.cpu_kinds
@pytest.mark.parametrize("heads", [16, 128])
def test_a_long_row_split(kernels: cpu_kernels.CpuKernels, heads: int) -> None:
    """One long row, split into spans merged after; the value the whole row (the backend's call)."""
    _check(kernels, [901], heads, (torch.float32, torch.bfloat16), LATENT)


@needs_compiler
@pytest.mark.cpu_kinds
def test_backend_routes_a_latent_pool(
    kernels: cpu_kernels.CpuKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A latent pool's decode rows (k is v, one pool for both) go to the kernel, and its new rows are
    written first: the backend's attention equals float64 over the pool it leaves."""
    calls: list[int] = []
    real = kernels.latent_attend

    def counted(*args: Any) -> None:
        calls.append(1)
        real(*args)

    monkeypatch.setattr(kernels, "latent_attend", counted)
    lens, heads = [5, 40], 16
    pool, page_table = _paged_pool(lens, torch.float32)
    page_table = page_table.to(torch.int64)
    positions, meta = cpu_attention.build_metadata(
        kernels, page_table, PAGE, [0, 1], [n - 1 for n in lens], [1, 1]
    )
    assert meta.all_decode and positions.tolist() == [n - 1 for n in lens]
    q, entry = torch.randn(2, heads, LATENT), torch.randn(2, 1, LATENT)
    out = cpu_attention.attend(kernels, meta, q, entry, entry, pool, pool, AttentionOptions(scale=0.05))
    assert calls == [1]
    for i, length in enumerate(lens):
        latents = _row_latents(pool, page_table, i, length)
        assert torch.equal(latents[-1], entry[i, 0])
        want = latent_reference(q[i], latents, LATENT, 0.05)
        assert (out[i].double() - want).abs().max() <= 2e-5 * want.abs().max()
