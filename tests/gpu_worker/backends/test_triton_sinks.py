"""The Triton attention kernels with a sink logit per head (gpt-oss's) against float64 torch, under
Triton's interpreter where there is no CUDA device: decode batches whose KV range is split in segments
(the sink joins the merge once), extend and mixed batches in one segment, a window; and the tiny
gpt-oss served on the Triton backend."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from tests.exactness import inprocess
from tests.gpu_worker.backends.attention_reference import PagedBatch, paged_batch

triton = pytest.importorskip("triton")
from gpu_worker.backends.triton import attention  # noqa: E402
from gpu_worker.backends.triton.kernels import attention_rows, paged_attention  # noqa: E402
from tests.gpu_worker.backends.test_triton_engine import first_divergence_within_top2  # noqa: E402
from tests.gpu_worker.backends.test_triton_kernels import DEVICE, TOLERANCE, sample_lens  # noqa: E402

pytestmark = pytest.mark.triton_interpreter


def sink_reference(batch: PagedBatch, scale: float, sinks: torch.Tensor, sliding_window: int) -> torch.Tensor:
    """Float64 causal attention of every row with each head's sink a column of its softmax."""
    q_heads, kv_heads = batch.q.shape[1], batch.k_cache.shape[1]
    outs, q_start = [], 0
    for idx, prefix_len, extend_len in zip(
        batch.req_pool_idx, batch.prefix_lens, batch.extend_lens, strict=True
    ):
        kv_pos = torch.arange(prefix_len + extend_len)
        locs = (
            batch.page_table[idx].cpu()[kv_pos // batch.page_size] * batch.page_size
            + kv_pos % batch.page_size
        )
        k = batch.k_cache.cpu()[locs].double().repeat_interleave(q_heads // kv_heads, dim=1)
        v = batch.v_cache.cpu()[locs].double().repeat_interleave(q_heads // kv_heads, dim=1)
        q = batch.q.cpu()[q_start : q_start + extend_len].double()
        scores = torch.einsum("thd,nhd->htn", q, k) * scale
        q_pos = prefix_len + torch.arange(extend_len)
        hidden = kv_pos[None, :] > q_pos[:, None]
        if sliding_window > 0:
            hidden |= kv_pos[None, :] <= q_pos[:, None] - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        sink = sinks.double()[:, None, None].expand(-1, extend_len, 1)
        probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
        outs.append(torch.einsum("htn,nhd->thd", probs, v))
        q_start += extend_len
    return torch.cat(outs)


@pytest.mark.parametrize(
    ("dtype", "shape", "window", "segmented"),
    [
        (torch.float32, "decode", 0, True),
        (torch.float32, "mixed", 0, False),
        (torch.bfloat16, "extend", 48, False),
    ],
    ids=["f32-decode-segments", "f32-mixed", "bf16-extend-window"],
)
def test_sinks_join_every_softmax(dtype: torch.dtype, shape: str, window: int, segmented: bool) -> None:
    rng = random.Random(f"sinks-{shape}")
    kv_heads, group, head_dim = 2, 4, 64
    lens = sample_lens(shape, rng)
    batch = paged_batch(lens, page_size=16, q_heads=kv_heads * group, kv_heads=kv_heads, head_dim=head_dim,
                        dtype=dtype, seed=rng.randint(0, 1 << 30), device=DEVICE)  # fmt: skip
    rows = attention_rows(batch.req_pool_idx, batch.prefix_lens, batch.extend_lens, DEVICE)
    tiles = attention._tiles(head_dim, group, rows.max_extend_len, dtype == torch.float32)
    programs = (batch.q.shape[0] // tiles.block_q + rows.num_rows) * kv_heads
    assert (attention._num_segments(rows, programs, tiles.block_n)[0] > 1) == segmented
    sinks = torch.tensor([-20.0, -1.0, 0.0, 0.5, 2.0, 4.0, 8.0, 30.0], device=DEVICE)
    out = torch.full_like(batch.q, float("nan"))
    scale = head_dim**-0.5
    paged_attention(batch.q, batch.k_cache, batch.v_cache, out, batch.page_table, batch.page_size, rows,
                    scale, sliding_window=window, sinks=sinks)  # fmt: skip
    tol = TOLERANCE[dtype]
    expected = sink_reference(batch, scale, sinks.cpu(), window)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=tol, atol=tol)


def test_triton_backend_serves_gpt_oss_as_hf_float32(tmp_path: Path) -> None:
    """The tiny gpt-oss (sinks, alternating windows shorter than the prompts) on the Triton backend,
    chunked prefill in mixed batches with a prefix-cache hit: HF float32's greedy tokens (the top-2
    rule of test_triton_engine.py at a first difference)."""
    from tests.exactness.test_gpt_oss import hf_gpt_oss, make_prompts, tiny_gpt_oss_config

    model = hf_gpt_oss(tiny_gpt_oss_config(layers=2), seed=3)
    model.save_pretrained(tmp_path, safe_serialization=True)
    model = model.to(torch.float32)
    config = WorkerConfig(model_path=str(tmp_path), dtype="float32", device_backend="triton", page_size=4,
                          kv_cache_tokens=1024, num_threads=1)  # fmt: skip
    runner = ModelRunner(config)
    assert runner.backend.name == "triton"
    prompts = make_prompts(seed=8, lens=(1, 17, 40, 9))
    prompts.append(prompts[2])  # a prefix-cache hit
    got, sched = inprocess.generate(runner, prompts, 6, chunked_prefill_size=16, enable_mixed_chunk=True)
    assert sched.num_cached_prompt_tokens > 0, "no prefix-cache hit"
    for i, (prompt, ours) in enumerate(zip(prompts, got, strict=True)):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
        first_divergence_within_top2(model, prompt, ours, out[0, len(prompt) :].tolist(), f"prompt {i}")
