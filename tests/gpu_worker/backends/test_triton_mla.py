"""Latent attention on the Triton backend (interpreted on CPU): the absorbed decode kernel against float64
torch, and tiny DeepSeek-V2 models served on the backend, every form, greedy-equal to HF float64.

The kernel's queries are MLA's: every head over one shared pool row a position (the latent and the
rope key), rows of different lengths over a shuffled page table, pages crossed mid-row, with the
plain softmax scale and with YaRN's mscale folded in (DeepSeek-V3's long-context configs).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.models.mla import softmax_scale
from protocol import ForwardBatch
from tests.exactness import inprocess
from tests.mla_models import hf_greedy, make_prompts, save_mla_model, tiny_mla_config
from tests.scheduler_proc.harness import batch_kinds

triton = pytest.importorskip("triton")  # a dependency on Linux x86-64 only
from gpu_worker.backends.triton import mla, mla_decode  # noqa: E402
from gpu_worker.backends.triton.mla_decode import LatentQueries, latent_decode  # noqa: E402

pytestmark = pytest.mark.triton_interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32, BF16 = torch.float32, torch.bfloat16


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    heads: int
    kv_rank: int
    rope_dim: int
    page_size: int
    positions: tuple[int, ...]  # each query's position: it sees 0..position of its own row
    yarn: bool
    pool_dtype: torch.dtype | None = None  # None: the queries' (a GPU's float32 runs over a bf16 pool)

    def __str__(self) -> str:
        name = f"{str(self.dtype).removeprefix('torch.')}-h{self.heads}-r{self.kv_rank}+{self.rope_dim}"
        name += f"-p{self.page_size}-{len(self.positions)}q" + ("-yarn" if self.yarn else "")
        return name + (f"-pool-{str(self.pool_dtype).removeprefix('torch.')}" if self.pool_dtype else "")


CASES = [
    Case(F32, 4, 32, 8, 4, (0, 5, 16, 37), yarn=False),  # GLM's tiny test shape; row ends on and off pages
    Case(F32, 20, 48, 16, 16, (3, 600), yarn=True),  # two head blocks, a split context (segments)
    Case(BF16, 16, 64, 16, 1, (9, 130, 77), yarn=False),
    Case(F32, 3, 32, 8, 16, (40, 41, 300), yarn=True),
    Case(F32, 16, 32, 16, 16, (0, 70), yarn=False, pool_dtype=BF16),
]


def _scale(case: Case) -> float:
    cfg = tiny_mla_config("v3" if case.yarn else "v2_lite")
    scale = softmax_scale(cfg, int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim))
    assert (scale != 24**-0.5) == case.yarn, "YaRN's mscale changes the scale, the plain config's does not"
    return scale


def _paged(case: Case, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A latent pool of random rows and a page table whose rows own shuffled pages: (pool, table, rows)."""
    ps, queries = case.page_size, len(case.positions)
    pages = [-(-(p + 1) // ps) for p in case.positions]
    total = sum(pages) + 3  # spare pages nobody owns
    table = torch.zeros((queries + 2, max(pages) + 1), dtype=torch.int64)
    free = torch.randperm(total, generator=gen).tolist()
    pool_idx = random.Random(str(case)).sample(range(queries + 2), queries)
    for idx, count in zip(pool_idx, pages, strict=True):
        table[idx, :count] = torch.tensor([free.pop() for _ in range(count)])
    pool = torch.randn((total * ps, 1, case.kv_rank + case.rope_dim), generator=gen)
    pool = pool.to(case.pool_dtype or case.dtype)
    return pool, table, pool_idx


def _reference(
    q_lat: torch.Tensor, q_rope: torch.Tensor, pool: torch.Tensor, table: torch.Tensor, pool_idx: list[int],
    case: Case, scale: float,
) -> torch.Tensor:  # fmt: skip
    outs = []
    for i, (idx, position) in enumerate(zip(pool_idx, case.positions, strict=True)):
        kv_pos = torch.arange(position + 1)
        rows = pool[
            table[idx, kv_pos // case.page_size] * case.page_size + kv_pos % case.page_size, 0
        ].double()
        latent, k_rope = rows[:, : case.kv_rank], rows[:, case.kv_rank :]
        scores = (q_lat[i].double() @ latent.T + q_rope[i].double() @ k_rope.T) * scale
        outs.append(scores.softmax(-1) @ latent)
    return torch.stack(outs)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_latent_decode_matches_float64(case: Case) -> None:
    gen = torch.Generator().manual_seed(len(str(case)))
    pool, table, pool_idx = _paged(case, gen)
    queries = len(case.positions)
    q_lat = torch.randn((queries, case.heads, case.kv_rank), generator=gen).to(case.dtype)
    q_rope = torch.randn((queries, case.heads, case.rope_dim), generator=gen).to(case.dtype)
    out = torch.full_like(q_lat, float("nan"))
    scale = _scale(case)
    meta = LatentQueries(
        pool_idx=torch.tensor(pool_idx, dtype=torch.int32, device=DEVICE),
        positions=torch.tensor(case.positions, dtype=torch.int32, device=DEVICE),
        max_kv_len=max(case.positions) + 1,
    )
    on = [t.to(DEVICE) for t in (q_lat, q_rope, pool, out, table)]
    latent_decode(on[0], on[1], on[2], on[3], on[4], case.page_size, meta, scale)
    expected = _reference(q_lat, q_rope, pool, table, pool_idx, case, scale)
    tol = 1e-5 if case.dtype == F32 else 2**-7
    torch.testing.assert_close(on[3].cpu().double(), expected, rtol=tol, atol=tol)


def test_only_few_long_queries_split_the_context() -> None:
    tiles = mla_decode._tiles(512, 64, fp32=False)
    assert (tiles.block_r, tiles.block_p) == (512, 64), "DeepSeek's 512 + 64 as two power-of-2 dots"
    assert mla_decode._num_segments(2, 1, 4000, tiles.block_n)[0] > 1, "a small long-context batch splits"
    assert mla_decode._num_segments(2, 1, 200, tiles.block_n)[0] == 1, "short contexts do not"
    assert mla_decode._num_segments(300, 1, 4000, tiles.block_n)[0] == 1, (
        "a batch that fills the GPU does not"
    )


NEW_TOKENS = 4
PROMPT_LENS = (1, 6, 21)


@pytest.fixture(scope="module")
def v2_lite(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, list[list[int]], list[list[int]]]:
    """DeepSeek-V2-Lite's shape: no q_lora_rank, complex rope, V heads of 16 against K heads of 16 + 8
    (the expanded form pads V). Its prompts, the longest again (a prefix-cache hit), and HF's tokens."""
    path = tmp_path_factory.mktemp("triton-mla")
    hf = save_mla_model("v2_lite", path)
    prompts = make_prompts(5, PROMPT_LENS)
    prompts.append(prompts[-1])
    return path, hf, prompts, hf_greedy(hf, prompts, NEW_TOKENS)


@pytest.mark.parametrize("form", ["auto", "absorbed", "expanded"])
def test_deepseek_v2_on_triton_matches_hf(
    v2_lite: tuple[Path, Any, list[list[int]], list[list[int]]], form: str
) -> None:
    """Chunked prefill, mixed batches and a prefix-cache hit on the Triton backend's latent kernels, each
    form for every row it takes: HF float64's greedy tokens."""
    path, _, prompts, expected = v2_lite
    config = WorkerConfig(model_path=str(path), dtype="float32", device_backend="triton", page_size=4,
                          kv_cache_tokens=256, num_threads=1, latent_attention=form)  # fmt: skip
    runner = ModelRunner(config)
    model: Any = runner.model
    attn = model.model.layers[0].self_attn
    assert attn.pooled_attention is mla.pooled_attention, "the Triton backend attaches its latent attention"
    batches: list[ForwardBatch] = []
    got, sched = inprocess.generate(
        runner, prompts, NEW_TOKENS, chunked_prefill_size=8, enable_mixed_chunk=True, batches=batches
    )
    assert sched.num_cached_prompt_tokens > 0, "no prefix-cache hit"
    assert "M" in batch_kinds(batches), "no mixed batch (prefill and decode rows together)"
    assert got == expected


def test_deepseek_v3_with_yarn_on_triton_matches_hf(tmp_path: Path) -> None:
    """DeepSeek-V3's YaRN rope with mscale (the kernels' softmax scale), interleaved rope, sigmoid
    routing: HF float64's greedy tokens under auto (prompt rows expanded, decode rows absorbed)."""
    hf = save_mla_model("v3", tmp_path)
    prompts = make_prompts(6, PROMPT_LENS)
    config = WorkerConfig(model_path=str(tmp_path), dtype="float32", device_backend="triton", page_size=16,
                          kv_cache_tokens=256, num_threads=1)  # fmt: skip
    got, _ = inprocess.generate(ModelRunner(config), prompts, NEW_TOKENS, chunked_prefill_size=8,
                                enable_mixed_chunk=True)  # fmt: skip
    assert got == hf_greedy(hf, prompts, NEW_TOKENS)
