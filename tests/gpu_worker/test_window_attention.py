"""The C decode attention over a sliding window (csrc/attention.c): each row attends its last
``window`` positions only, as HF's sliding-window mask keeps them, whole or split over threads
(few rows), with a score scale of its own; and a windowed model decodes through the kernel as HF
runs it (float32 against float64)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from tests.gpu_worker.helpers import GREEDY, VOCAB, MiniScheduler
from tests.gpu_worker.test_cpu_kernels import DTYPE_IDS, DTYPES, needs_compiler, reference


@needs_compiler
@pytest.mark.parametrize(("dtype", "kv_dtype"), DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    ("lens", "window"), [([1, 5, 17, 64, 65, 200], 16), ([300, 2], 64), ([1000], 300), ([40, 333], 5000)]
)
@pytest.mark.parametrize("threads", [1, 3])
def test_rows_attend_their_last_window_positions(
    kernels: cpu_kernels.CpuKernels,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    lens: list[int],
    window: int,
    threads: int,
) -> None:
    """Lengths below, at and past the window; few long rows (their positions split over threads in
    AVX2/portable builds); the positions before the window hold NaN, so reading one shows; a scale
    other than 1/sqrt(D)."""
    torch.manual_seed(5)
    heads, kv_heads, head_dim, page_size = 6, 2, 64, 16
    pages_per_row = -(-max(lens) // page_size)
    k_cache = torch.randn(len(lens) * pages_per_row * page_size, kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    page_table = torch.randperm(len(lens) * pages_per_row).view(len(lens), pages_per_row).contiguous()
    for r, n in enumerate(lens):
        pos = torch.arange(max(0, n - window))  # outside the window
        locs = page_table[r, pos // page_size] * page_size + pos % page_size
        k_cache[locs], v_cache[locs] = float("nan"), float("nan")
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    q = (torch.randn(len(lens), heads, head_dim) * 2).to(dtype)
    out = torch.empty_like(q)
    ids = torch.arange(len(lens))
    rows = kernels.decode_rows(ids, ids, torch.tensor(lens), page_table, page_size)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernels.attend(q, k_cache, v_cache, out, rows, sliding_window=window, scale=0.07)
    finally:
        torch.set_num_threads(before)
    tol = 1e-5 if dtype == torch.float32 and kv_dtype == torch.float32 else 2e-2
    for r, n in enumerate(lens):
        pos = torch.arange(max(0, n - window), n)
        locs = page_table[r, pos // page_size] * page_size + pos % page_size
        ref = reference(q[r] * (0.07 * head_dim**0.5), k_cache[locs], v_cache[locs])
        torch.testing.assert_close(out[r].double(), ref, rtol=tol, atol=tol)


def test_windowed_model_decodes_through_the_kernel_as_hf(tmp_path: Path) -> None:
    """A Mistral with a 24-token window, float32 with the C kernels: prompts longer than the window,
    prefilled, then decoded by the kernel, give HF float64's greedy tokens. (Logits within 0.05 of
    HF's, of up to ~8: the C float32 path's own matmuls differ by ~0.01 here, window or not; over
    positions outside the window they would differ by far more.)"""
    import transformers

    from tests.models import tiny_config

    config = tiny_config("mistral", False)
    config.sliding_window = 24
    torch.manual_seed(2)
    hf: Any = transformers.MistralForCausalLM(config)
    hf = hf.to(torch.float64).eval()
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0
    hf.save_pretrained(tmp_path, safe_serialization=True)
    runner = ModelRunner(
        WorkerConfig(
            model_path=str(tmp_path), dtype="float32", kv_cache_tokens=1024, page_size=16, num_threads=1
        )
    )
    assert getattr(runner.backend, "kernels", None) is not None, "the C kernels must be built for this test"
    rng = random.Random(4)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (30, 61, 100)]
    sched = MiniScheduler(runner.num_pages, 16)
    got: list[list[int]] = [[] for _ in prompts]
    first = runner.execute(sched.batch([(i, 0, p, True, GREEDY) for i, p in enumerate(prompts)])).token_ids
    for out, token in zip(got, first, strict=True):
        out.append(token)
    for _ in range(7):  # decode steps: every row by the kernel
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
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8)
        assert out == want[0, len(p) :].tolist()
