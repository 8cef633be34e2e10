"""The C decode attention with a sink logit per head (csrc/attention.c, gpt-oss's sinks): one more term
in each head's softmax, with no value, on every path (many rows, few long rows split over threads, a
window, a request's adjacent verify rows); and a gpt-oss decoding through the kernel as HF runs it
(float32 against float64)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from tests.gpu_worker.helpers import GREEDY, MiniScheduler
from tests.gpu_worker.test_cpu_kernels import DTYPE_IDS, DTYPES, needs_compiler


def sink_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """One row in float64: q [Hq, D] over k, v [L, Hkv, D], each head's sink a column of its softmax."""
    group = q.shape[0] // k.shape[1]
    k64 = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
    v64 = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.einsum("hd,hld->hl", q.double(), k64) * scale
    probs = torch.softmax(torch.cat((scores, sinks.double()[:, None]), dim=1), dim=1)[:, :-1]
    return torch.einsum("hl,hld->hd", probs, v64)


def paged_kv(lens: list[int], kv_heads: int, head_dim: int, page_size: int) -> tuple[torch.Tensor, ...]:
    """Random K/V caches and a shuffled page table holding one row of each length."""
    pages_per_row = -(-max(lens) // page_size)
    k_cache = torch.randn(len(lens) * pages_per_row * page_size, kv_heads, head_dim)
    page_table = torch.randperm(len(lens) * pages_per_row).view(len(lens), pages_per_row).contiguous()
    return k_cache, torch.randn_like(k_cache), page_table


@needs_compiler
@pytest.mark.parametrize(("dtype", "kv_dtype"), DTYPES[:2], ids=DTYPE_IDS[:2])
@pytest.mark.parametrize(
    ("lens", "window", "threads"),
    [([1, 5, 17, 64, 65, 200], 0, 1), ([1000], 0, 3), ([300, 40], 64, 3)],
    ids=["rows", "split", "window"],
)
def test_rows_attend_with_a_sink_per_head(
    kernels: cpu_kernels.CpuKernels,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    lens: list[int],
    window: int,
    threads: int,
) -> None:
    """Sinks from far below to far above the scores (a head whose sink takes nearly all the weight);
    many rows, one long row (split over threads), a window."""
    torch.manual_seed(6)
    heads, kv_heads, head_dim, page_size = 8, 2, 64, 16
    k_cache, v_cache, page_table = paged_kv(lens, kv_heads, head_dim, page_size)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    q = (torch.randn(len(lens), heads, head_dim) * 2).to(dtype)
    sinks = torch.tensor([-30.0, -2.0, 0.0, 1.0, 3.0, 6.0, 12.0, 40.0])
    out = torch.empty_like(q)
    ids = torch.arange(len(lens))
    rows = kernels.decode_rows(ids, ids, torch.tensor(lens), page_table, page_size)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernels.attend(q, k_cache, v_cache, out, rows, sliding_window=window, scale=0.1, sinks=sinks)
    finally:
        torch.set_num_threads(before)
    tol = 1e-5 if dtype == torch.float32 and kv_dtype == torch.float32 else 2e-2
    for r, n in enumerate(lens):
        pos = torch.arange(max(0, n - window) if window else 0, n)
        locs = page_table[r, pos // page_size] * page_size + pos % page_size
        ref = sink_reference(q[r], k_cache[locs], v_cache[locs], sinks, 0.1)
        torch.testing.assert_close(out[r].double(), ref, rtol=tol, atol=tol)


@needs_compiler
def test_a_requests_adjacent_rows_take_the_sinks(kernels: cpu_kernels.CpuKernels) -> None:
    """A verify row's positions (adjacent rows of one request, each over the positions up to its own),
    which AVX-512 builds attend together reading the KV once: the sinks join each row's softmax."""
    torch.manual_seed(7)
    heads, kv_heads, head_dim, page_size, n = 4, 2, 32, 16, 70
    k_cache, v_cache, page_table = paged_kv([n], kv_heads, head_dim, page_size)
    q = torch.randn(5, heads, head_dim)
    sinks = torch.tensor([2.0, -1.0, 0.5, 4.0])
    lens = torch.arange(n - 4, n + 1)
    out = torch.empty_like(q)
    rows = kernels.decode_rows(
        torch.arange(5), torch.zeros(5, dtype=torch.int64), lens, page_table, page_size
    )
    kernels.attend(q, k_cache, v_cache, out, rows, sinks=sinks)
    for r, length in enumerate(lens.tolist()):
        pos = torch.arange(length)
        locs = page_table[0, pos // page_size] * page_size + pos % page_size
        ref = sink_reference(q[r], k_cache[locs], v_cache[locs], sinks, head_dim**-0.5)
        torch.testing.assert_close(out[r].double(), ref, rtol=1e-5, atol=1e-5)


def test_gpt_oss_decodes_through_the_kernel_as_hf(tmp_path: Path) -> None:
    """The tiny gpt-oss in float32 with the C kernels: prompts past its window prefilled, then decoded
    by the kernel (sinks and windows), give HF float64's logits (within 0.05) and greedy tokens."""
    from tests.exactness.test_gpt_oss import VOCAB, hf_gpt_oss, tiny_gpt_oss_config

    hf: Any = hf_gpt_oss(tiny_gpt_oss_config(layers=2), seed=2)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    config = WorkerConfig(model_path=str(tmp_path), dtype="float32", kv_cache_tokens=1024, page_size=16,
                          num_threads=1)  # fmt: skip
    runner = ModelRunner(config)
    assert getattr(runner.backend, "kernels", None) is not None, "the C kernels must be built for this test"
    rng = random.Random(4)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (30, 11, 47)]
    sched = MiniScheduler(runner.num_pages, 16)
    got: list[list[int]] = [[] for _ in prompts]
    first = runner.execute(sched.batch([(i, 0, p, True, GREEDY) for i, p in enumerate(prompts)])).token_ids
    for out, token in zip(got, first, strict=True):
        out.append(token)
    for _ in range(5):  # decode steps: every row by the kernel
        batch = sched.batch(
            [(i, len(p) + len(got[i]) - 1, [got[i][-1]], True, None) for i, p in enumerate(prompts)]
        )
        logits = runner.compute_logits(batch)
        for i, p in enumerate(prompts):
            with torch.no_grad():
                ref = hf(torch.tensor([p + got[i]])).logits[0, -1]
            torch.testing.assert_close(logits[i].double(), ref, rtol=0, atol=0.05)
            got[i].append(int(logits[i].argmax()))
    for p, out in zip(prompts, got, strict=True):
        ids = torch.tensor([p])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6)
        assert out == want[0, len(p) :].tolist()
