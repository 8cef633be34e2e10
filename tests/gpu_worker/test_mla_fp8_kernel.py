"""A float8 e4m3 latent pool (--kv-cache-dtype fp8_e4m3) on csrc/mla.c's absorbed decode: every byte
read as torch reads it (each of the 256 codes, subnormals and +-448 included), the attention against
float64 over the pool's rounded latents, and the pool's writes saturated and copied as bytes."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.backends.cpu import attention as cpu_attention
from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.forward_context import AttentionOptions
from gpu_worker.kv_cache import copy_rows, store_rows
from tests.gpu_worker.test_cpu_kernels import needs_compiler
from tests.gpu_worker.test_mla_decode_kernel import LATENT, PAGE, RANK, latent_reference

FP8 = torch.float8_e4m3fn


def _one_position(kernels: cpu_kernels.CpuKernels, row: torch.Tensor) -> torch.Tensor:
    """The kernel's output over a pool of the one latent ``row`` [LATENT] (its softmax weight 1): the
    row itself, widened."""
    pool = row.view(1, 1, LATENT)
    q, out = torch.zeros(1, 1, LATENT), torch.empty(1, 1, LATENT)
    page_table = torch.zeros(1, 1, dtype=torch.int64)
    rows = kernels.decode_rows(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                               torch.ones(1, dtype=torch.int64), page_table, 1)  # fmt: skip
    kernels.latent_attend(q, pool, out, rows, LATENT, 1.0)
    return out[0, 0]


@needs_compiler
@pytest.mark.cpu_kinds
def test_every_byte_widens_as_torch_widens(kernels: cpu_kernels.CpuKernels) -> None:
    """All 254 non-NaN codes, each at two lane offsets of the vector loops (a row of 576 bytes holds
    them twice, the second time shifted by 3 lanes), exactly."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    row = torch.cat([codes, codes.roll(3), codes[: LATENT - 2 * len(codes)]]).view(FP8)
    got, want = _one_position(kernels, row), row.float()
    assert torch.equal(got, want)  # exactly: subnormals included (-0.0 sums to 0.0 in the softmax's sum)


@needs_compiler
@pytest.mark.cpu_kinds
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [16, 128])
def test_rows_against_float64(kernels: cpu_kernels.CpuKernels, q_dtype: torch.dtype, heads: int) -> None:
    """Rows at lengths off the page size over a random float8 pool (values up to saturation and down
    into the subnormals), against float64 over the same rounded latents."""
    torch.manual_seed(heads)
    lens = [1, 37, 300]
    per_row = -(-max(lens) // PAGE)
    wide = torch.randn(len(lens) * per_row * PAGE, 1, LATENT) * torch.logspace(-3, 2.5, LATENT)
    pool = torch.empty(wide.shape, dtype=FP8)
    store_rows(pool, torch.arange(len(pool)), wide)
    page_table = torch.randperm(len(lens) * per_row).view(len(lens), per_row).contiguous()
    q = (torch.randn(len(lens), heads, LATENT) * 0.02).to(q_dtype)
    out = torch.zeros(len(lens), heads, RANK, dtype=q_dtype)
    rows = kernels.decode_rows(
        torch.arange(len(lens)), torch.arange(len(lens)), torch.tensor(lens), page_table, PAGE
    )
    kernels.latent_attend(q, pool, out, rows, RANK, LATENT**-0.5)
    tolerance = 2e-5 if q_dtype == torch.float32 else 1e-2  # float32 sums; bf16's output rounding
    for i, length in enumerate(lens):
        pos = torch.arange(length)
        latents = pool[page_table[i, pos // PAGE] * PAGE + pos % PAGE, 0].double()
        want = latent_reference(q[i], latents, RANK, LATENT**-0.5)
        assert (out[i].double() - want).abs().max() <= tolerance * want.abs().max(), (i, length)


def test_writes_saturate_and_copy_as_bytes() -> None:
    """Values past e4m3's range are stored as +-448, never NaN; a row copied (forks.py) keeps its bytes."""
    pool = torch.zeros(4, 1, 3, dtype=FP8)
    store_rows(pool, torch.tensor([2]), torch.tensor([[[1000.0, -1e6, 0.3]]]))
    assert pool[2].float().tolist() == [[448.0, -448.0, 0.3125]]
    copy_rows(pool, torch.tensor([2]), torch.tensor([0]))
    assert torch.equal(pool[0].view(torch.uint8), pool[2].view(torch.uint8))


@needs_compiler
@pytest.mark.cpu_kinds
def test_backend_attends_a_float8_pool(kernels: cpu_kernels.CpuKernels) -> None:
    """The CPU backend's attention over a float8 latent pool: a decode row on the kernel and a prompt
    row longer than the kernel's extend rows by torch, the new rows written (rounded) first."""
    heads, scale = 16, 0.05
    torch.manual_seed(1)
    pool = torch.empty(5 * PAGE, 1, LATENT, dtype=FP8)
    store_rows(pool, torch.arange(len(pool)), torch.randn(len(pool), 1, LATENT))
    page_table = torch.tensor([[0, 1, 2], [3, 4, 0]], dtype=torch.int64)
    _, meta = cpu_attention.build_metadata(kernels, page_table, PAGE, [0, 1], [39, 0], [1, 20])
    assert not meta.all_decode and meta.paged_decode is not None
    q, entry = torch.randn(21, heads, LATENT) * 0.1, torch.randn(21, 1, LATENT)
    out = cpu_attention.attend(kernels, meta, q, entry, entry, pool, pool, AttentionOptions(scale=scale))
    assert torch.equal(pool[39, 0].view(torch.uint8), entry[0, 0].to(FP8).view(torch.uint8))
    assert torch.equal(pool[48:68, 0].view(torch.uint8), entry[1:, 0].to(FP8).view(torch.uint8))
    want = latent_reference(q[0], pool[:40, 0].double(), LATENT, scale)
    assert (out[0].double() - want).abs().max() <= 2e-5 * want.abs().max()
    for j in range(20):  # the prompt row (no prefix) attends its own latents as stored, causally
        want = latent_reference(q[1 + j], entry[1 : 2 + j, 0].to(FP8).double(), LATENT, scale)
        assert (out[1 + j].double() - want).abs().max() <= 2e-5 * want.abs().max(), j
