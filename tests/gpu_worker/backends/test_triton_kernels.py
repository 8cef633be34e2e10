"""The Triton backend's kernels against float64 torch: paged attention of every batch shape, the K/V write.

Without a CUDA device they run under Triton's interpreter (about 3 ms per kernel loop step), so the
matrix of dtypes x head dims x GQA groups x page sizes x batch shapes is sampled, not multiplied out:
every value of every axis appears at least once.

Tolerances (absolute and relative alike): fp32 1e-5; the kernel's math is fp32 and its fp32 dot is
"ieee" on GPU too. bf16 2**-7, one ulp at 1.0: the interpreter's fp32 -> bf16 store truncates (the
GPU rounds to nearest), so its outputs are up to one ulp off. fp16 2**-9: half an ulp of output
rounding plus, on GPU, the TF32 rounding of the probabilities in P @ V (a 10-bit mantissa, as HF's
own fp16 probabilities have).
"""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from tests.gpu_worker.backends.attention_reference import PagedBatch, paged_batch, reference_attention

# triton is a dependency on Linux x86-64 only; the kernel modules import it, so they come after this.
triton = pytest.importorskip("triton")
from gpu_worker.backends.triton import attention  # noqa: E402
from gpu_worker.backends.triton.kernels import attention_rows, paged_attention, write_kv  # noqa: E402

pytestmark = pytest.mark.triton_interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-9}
MAX_LEN = 700  # the longest row, prefix and new tokens together


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    head_dim: int
    group: int
    kv_heads: int
    page_size: int
    shape: str  # "decode", "extend" or "mixed"
    sliding_window: int = 0
    logit_softcap: float = 0.0

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        name = f"{dtype}-d{self.head_dim}-g{self.group}x{self.kv_heads}-p{self.page_size}-{self.shape}"
        if self.sliding_window > 0:
            name += f"-w{self.sliding_window}"
        if self.logit_softcap > 0:
            name += f"-cap{self.logit_softcap:g}"
        return name


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CASES = [
    Case(F32, 128, 1, 2, 16, "mixed"),
    Case(F32, 64, 4, 1, 1, "extend"),
    Case(F32, 256, 2, 1, 16, "decode"),
    Case(F32, 80, 2, 1, 16, "mixed", logit_softcap=30.0),
    Case(F32, 32, 8, 1, 1, "decode", sliding_window=40),
    Case(BF16, 128, 8, 1, 16, "mixed"),
    Case(BF16, 80, 2, 2, 1, "decode"),
    Case(BF16, 256, 2, 1, 16, "mixed", sliding_window=64, logit_softcap=50.0),  # Gemma 2
    Case(BF16, 64, 1, 2, 16, "extend", sliding_window=100),
    Case(BF16, 16, 4, 1, 1, "extend"),
    Case(F16, 96, 4, 1, 16, "extend"),
    Case(F16, 32, 1, 4, 1, "mixed"),
    Case(F16, 16, 8, 1, 16, "decode"),
    Case(F16, 128, 4, 1, 16, "mixed", sliding_window=128, logit_softcap=50.0),
]


def sample_lens(shape: str, rng: random.Random) -> list[tuple[int, int]]:
    """(prefix_len, extend_len) rows of a batch shape; totals up to MAX_LEN, prefixes ending anywhere."""
    decode = [(rng.randint(1, MAX_LEN - 1), 1) for _ in range(3)]
    total = rng.randint(200, MAX_LEN)
    chunk = rng.randint(30, 120)
    extend = [(0, rng.randint(40, 160)), (total - chunk, chunk)]  # a whole prompt, a later chunk of one
    if shape == "decode":
        return decode + [(MAX_LEN - 1, 1)]
    if shape == "extend":
        return extend
    return [decode[0], extend[0], decode[1], (rng.randint(0, 40), 1), extend[1]]


def run_attention(batch: PagedBatch, case: Case, out: torch.Tensor | None = None) -> torch.Tensor:
    rows = attention_rows(batch.req_pool_idx, batch.prefix_lens, batch.extend_lens, DEVICE)
    out = torch.full_like(batch.q, float("nan")) if out is None else out
    scale = case.head_dim**-0.5
    paged_attention(
        batch.q, batch.k_cache, batch.v_cache, out, batch.page_table, batch.page_size, rows, scale,
        sliding_window=case.sliding_window, logit_softcap=case.logit_softcap,
    )  # fmt: skip
    return out


def assert_matches_reference(out: torch.Tensor, batch: PagedBatch, case: Case) -> None:
    expected = reference_attention(batch, case.head_dim**-0.5, case.sliding_window, case.logit_softcap)
    tol = TOLERANCE[case.dtype]
    torch.testing.assert_close(out.cpu().double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_paged_attention_matches_float64(case: Case) -> None:
    rng = random.Random(str(case))
    batch = paged_batch(
        sample_lens(case.shape, rng),
        page_size=case.page_size,
        q_heads=case.group * case.kv_heads,
        kv_heads=case.kv_heads,
        head_dim=case.head_dim,
        dtype=case.dtype,
        seed=rng.randint(0, 1 << 30),
        device=DEVICE,
    )
    assert_matches_reference(run_attention(batch, case), batch, case)


def test_strided_q_and_out_from_fused_tensors() -> None:
    # The backend slices q out of a fused QKV projection and may write into a wider buffer.
    case = Case(BF16, 64, 2, 2, 16, "mixed")
    batch = paged_batch([(17, 1), (0, 37)], page_size=16, q_heads=4, kv_heads=2, head_dim=64, dtype=BF16,
                        seed=3, device=DEVICE)  # fmt: skip
    fused = torch.randn((38, 8, 64), device=DEVICE).to(BF16)
    fused[:, 2:6] = batch.q
    wide_out = torch.zeros((38, 6, 64), dtype=BF16, device=DEVICE)
    strided = PagedBatch(**{**vars(batch), "q": fused[:, 2:6]})
    run_attention(strided, case, out=wide_out[:, 1:5])
    assert_matches_reference(wide_out[:, 1:5], batch, case)
    assert not wide_out[:, [0, 5]].any(), "attention wrote outside its out view"


def test_only_small_decode_like_batches_split_the_kv_range() -> None:
    def segments(prefix_lens: list[int], extend_lens: list[int], kv_heads: int) -> int:
        rows = attention_rows(list(range(len(prefix_lens))), prefix_lens, extend_lens, DEVICE)
        tiles = attention._tiles(128, 4, rows.max_extend_len, fp32=False)
        programs = (rows.num_tokens // tiles.block_q + rows.num_rows) * kv_heads
        count, tiles_per_segment = attention._num_segments(rows, programs, tiles.block_n)
        assert count * tiles_per_segment >= triton.cdiv(rows.max_kv_len, tiles.block_n), "tiles left out"
        return count

    assert segments([5000, 300], [1, 1], kv_heads=2) > 1, "a small long-context decode batch splits"
    assert segments([100, 200], [1, 1], kv_heads=2) == 1, "short contexts do not"
    assert segments([5000] * 200, [1] * 200, kv_heads=8) == 1, "a batch that fills the GPU does not"
    assert segments([5000, 0], [1, 500], kv_heads=2) == 1, "a prompt in the batch does not"


def test_attention_rows_packs_the_batch() -> None:
    rows = attention_rows([4, 0, 2], [10, 0, 33], [1, 7, 2], DEVICE)
    assert rows.req_pool_idx.tolist() == [4, 0, 2] and rows.prefix_lens.tolist() == [10, 0, 33]
    assert rows.q_starts.tolist() == [0, 1, 8, 10]
    assert {t.dtype for t in (rows.req_pool_idx, rows.q_starts, rows.prefix_lens)} == {torch.int32}
    assert (rows.num_tokens, rows.num_rows, rows.max_extend_len, rows.max_kv_len) == (10, 3, 7, 35)


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
def test_write_kv_stores_each_token_in_its_row(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn((64, 2, 80), generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn((64, 2, 80), generator=gen).to(dtype).to(DEVICE)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    # k and v as views of a fused QKV output, [T, Hq + 2 * Hkv, D] with Hq = 4: strided tokens.
    qkv = torch.randn((9, 8, 80), generator=gen).to(dtype).to(DEVICE)
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    out_locs = torch.randperm(64, generator=gen)[:9].to(DEVICE)
    write_kv(k_cache, v_cache, k, v, out_locs)
    assert torch.equal(k_cache[out_locs], k) and torch.equal(v_cache[out_locs], v)
    untouched = torch.ones(64, dtype=torch.bool, device=DEVICE)
    untouched[out_locs] = False
    assert torch.equal(k_cache[untouched], before_k[untouched])
    assert torch.equal(v_cache[untouched], before_v[untouched])


@pytest.mark.parametrize("kv_dtype", [BF16, F16], ids=str)
def test_float32_activations_over_a_16_bit_pool(kv_dtype: torch.dtype) -> None:
    """--kv-cache-dtype: float32 K/V are rounded into the 16-bit pool as torch rounds them (to one ulp
    of bf16 where the interpreter truncates), and float32 queries attend over the pool as stored, in
    float32 math: against the float64 reference of those stored values, float32's tolerance."""
    gen = torch.Generator().manual_seed(4)
    k_cache = torch.zeros((64, 2, 32), dtype=kv_dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k, v = (
        torch.randn((9, 2, 32), generator=gen).to(DEVICE),
        torch.randn((9, 2, 32), generator=gen).to(DEVICE),
    )
    out_locs = torch.randperm(64, generator=gen)[:9].to(DEVICE)
    write_kv(k_cache, v_cache, k, v, out_locs)
    tol = 2**-7 if kv_dtype == BF16 and DEVICE == "cpu" else 0.0
    torch.testing.assert_close(k_cache[out_locs], k.to(kv_dtype), rtol=tol, atol=tol)
    torch.testing.assert_close(v_cache[out_locs], v.to(kv_dtype), rtol=tol, atol=tol)

    case = Case(F32, 64, 3, 1, 16, "mixed")
    lens = sample_lens(case.shape, random.Random(str(kv_dtype)))
    batch = paged_batch(
        lens, page_size=16, q_heads=3, kv_heads=1, head_dim=64, dtype=F32, seed=5, device=DEVICE
    )
    batch = dataclasses.replace(batch, k_cache=batch.k_cache.to(kv_dtype), v_cache=batch.v_cache.to(kv_dtype))
    assert_matches_reference(run_attention(batch, case), batch, case)


INTERPRETED_AFTER_TRITON = """
import triton.language  # compiled-mode library, as when torch.compile's inductor imported triton first
import torch
from tests.gpu_worker.backends.test_triton_kernels import Case, F32, paged_batch, run_attention
from tests.gpu_worker.backends.test_triton_kernels import assert_matches_reference
case = Case(F32, 32, 2, 1, 16, "mixed")
batch = paged_batch([(20, 1), (3, 18)], page_size=16, q_heads=2, kv_heads=1, head_dim=32, dtype=F32,
                    seed=1, device="cpu")
assert_matches_reference(run_attention(batch, case), batch, case)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter serves machines without CUDA")
def test_kernels_are_interpreted_when_triton_was_imported_first() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", INTERPRETED_AFTER_TRITON], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def test_kernels_compile_for_an_h100() -> None:
    # The interpreter does not run Triton's compiler; this builds sm_90 cubins with the wheel's ptxas.
    pytest.importorskip("triton.backends.nvidia.compiler", reason="this triton has no NVIDIA backend")
    done = subprocess.run([sys.executable, "-m", "tests.gpu_worker.backends.compile_for_gpu", "90"],
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("attention ") == 6 and "write_kv" in done.stdout, done.stdout
    assert done.stdout.count("latent decode ") == 4, done.stdout
