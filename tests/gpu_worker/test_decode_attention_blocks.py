"""The C decode attention (csrc/attention.c) at the edges of its 16-position blocks and of its
float16 KV writes: every count of valid positions in a row's last block (whose other positions it
does not score) with the softmax's max fixed from the first block, rising in the last, or moving
throughout; and a row's new K/V rounded to a float16 pool as torch rounds them, 8 at a time and in
the tail, at the half's edges (subnormals, ties, the largest half, past it, infinities, NaN)."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.backends.cpu import kernels as cpu_kernels
from tests.gpu_worker.test_cpu_kernels import DTYPE_IDS, DTYPES, assert_rows_attend, needs_compiler


@needs_compiler
@pytest.mark.parametrize(("dtype", "kv_dtype"), DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(32, 8, 64), (8, 4, 128), (6, 2, 64), (4, 4, 80)]
)  # (32, 8, 64) and (8, 4, 128): the register-held scores; the others the general ones
@pytest.mark.parametrize(("peak", "threads"), [("first", 1), ("last", 3), ("none", 1)])
def test_every_fill_of_the_last_block(
    kernels: cpu_kernels.CpuKernels,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    peak: str,
    threads: int,
) -> None:
    """Rows of 1-49 positions (1-16 valid in the last block, one to four blocks); ``peak``: one
    position whose keys align with q, the first (the max set by the first block and never moved:
    no rescale) or each row's last (the max rising in the last block), or none (random scores). The
    pool's rows past each row's end hold NaN: a score or value read there shows."""
    torch.manual_seed(11)
    lens = list(range(1, 50))
    rows, page_size = len(lens), 16
    pages_per_row = -(-max(lens) // page_size) + 1
    pool = rows * pages_per_row * page_size
    k_cache = torch.full((pool, kv_heads, head_dim), float("nan"))
    v_cache = torch.full((pool, kv_heads, head_dim), float("nan"))
    page_table = torch.randperm(rows * pages_per_row).view(rows, pages_per_row).contiguous()
    q = torch.randn(rows, heads, head_dim)
    for r, n in enumerate(lens):
        pos = torch.arange(n)
        locs = page_table[r, pos // page_size] * page_size + pos % page_size
        k_cache[locs] = torch.randn(n, kv_heads, head_dim)
        v_cache[locs] = torch.randn(n, kv_heads, head_dim)
        if peak != "none":  # the KV heads' keys along their first query head's q
            at = locs[0] if peak == "first" else locs[-1]
            k_cache[at] = q[r].view(kv_heads, heads // kv_heads, head_dim)[:, 0] * 0.5
    k_cache, v_cache, q = k_cache.to(kv_dtype), v_cache.to(kv_dtype), q.to(dtype)
    out = torch.empty(rows, heads, head_dim, dtype=dtype)
    ids = torch.arange(rows)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernels.attend(
            q, k_cache, v_cache, out, kernels.decode_rows(ids, ids, torch.tensor(lens), page_table, page_size)
        )
    finally:
        torch.set_num_threads(previous)
    assert_rows_attend(out, q, k_cache, v_cache, page_table, page_size, lens)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kv_heads", "head_dim"), [(2, 64), (1, 36)])  # 36: 4 vectors of 8 and a tail of 4
def test_new_kv_rounds_to_float16_as_torch(
    kernels: cpu_kernels.CpuKernels, dtype: torch.dtype, kv_heads: int, head_dim: int
) -> None:
    """Each row's new K and V land in a float16 pool with torch's bits (round to nearest even, a
    subnormal half, the largest half 65504, infinity past 65520) and a NaN as NaN."""
    torch.manual_seed(4)
    rows, heads, page_size = 5, 2 * kv_heads, 16
    edges = [6e-8, 2.9802322e-8, 8.940697e-8, 1e-45, -6.1e-5, 6.1035156e-5, 65504.0, 65519.0, 65520.0, 7e4]
    edges += [-0.0, float("inf"), -float("inf"), 1.0 + 2**-11, 1.0 + 3 * 2**-11, 1 / 3, 1e-7, -2.5e-6]
    k = torch.randn(rows, kv_heads, head_dim).to(dtype)
    v = torch.randn(rows, kv_heads, head_dim).to(dtype)
    for t in (k, v):  # the edges at random places of every row, some in the 8-value tail
        flat = t.view(rows, -1)
        for r in range(rows):
            at = torch.randperm(flat.shape[1])[: len(edges)]
            flat[r, at] = torch.tensor(edges).to(dtype)
    k[1, 0, 3] = v[2, 0, head_dim - 1] = float("nan")
    q = torch.randn(rows, heads, head_dim).to(dtype)
    lens = [3, 17, 1, 40, 16]
    pages_per_row = -(-max(lens) // page_size)
    k_cache = torch.zeros(rows * pages_per_row * page_size, kv_heads, head_dim, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    page_table = torch.randperm(rows * pages_per_row).view(rows, pages_per_row).contiguous()
    out = torch.empty(rows, heads, head_dim, dtype=dtype)
    ids = torch.arange(rows)
    kernels.attend(
        q,
        k_cache,
        v_cache,
        out,
        kernels.decode_rows(ids, ids, torch.tensor(lens), page_table, page_size),
        (k, v),
    )
    for r, n in enumerate(lens):
        at = page_table[r, (n - 1) // page_size] * page_size + (n - 1) % page_size
        for new, cache in ((k[r], k_cache[at]), (v[r], v_cache[at])):
            expected = new.to(torch.float16)
            nan = expected.isnan()
            assert torch.equal(cache.isnan(), nan)
            assert torch.equal(cache[~nan].view(torch.int16), expected[~nan].view(torch.int16))
