"""The screened greedy head (csrc/head_screen.c, cpu/head_screen.py): a 16-bit head's one-row argmax
from its int8 copy is the full route's (csrc/quant.c's quant_matmul_argmax) token, bit for bit: on
random heads and many rows x, on every CPU kind this CPU runs, BF16 and F16, float32 and bfloat16
rows, one thread and two; on adversarial heads (rows copied, rows one bit apart, near-copies whose
int8 order differs from their exact order, huge, tiny and zero x); the candidates' exact values are
the full route's logits there, bit for bit; and a tiny gpt-oss (a BF16 head) draws the same tokens
with the screen forced on as with it off."""

from __future__ import annotations

import ctypes
import shutil
from typing import Any

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_worker.backends.cpu import head_screen as screen_mod
from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.head_screen import HeadScreen
from gpu_worker.backends.cpu.quant import QuantLinear
from gpu_worker.weights.formats import QuantBlocks, QuantizedWeight
from tests.gpu_worker.helpers import GREEDY, MiniScheduler

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

K = 256
TYPES = [Q.BF16, Q.F16]
TORCH_16 = {Q.BF16: torch.bfloat16, Q.F16: torch.float16}


def blocks(w: torch.Tensor, qtype: Q) -> QuantBlocks:
    """float32 [n, k] as the 16-bit blocks of ``qtype`` (the file's layout)."""
    data = w.to(TORCH_16[qtype]).contiguous().view(torch.uint8).reshape(w.shape[0], -1).clone()
    return QuantBlocks(int(qtype), data, w.shape[1])


def screened(kernels: cpu_kernels.CpuKernels, part: QuantBlocks) -> QuantLinear:
    screen = HeadScreen.build(kernels, part)
    assert screen is not None
    lin = QuantLinear(QuantizedWeight((part,)), None, kernels, screen)
    assert lin.screen is screen, "one row takes the one-row tile on every kind"
    return lin


def check(kernels: cpu_kernels.CpuKernels, lin: QuantLinear, x: torch.Tensor) -> int:
    """The screen's token == the full route's; its candidates' exact values == the head's logits
    there, bit for bit; returns the candidates counted (-1: the full route ran)."""
    part, screen = lin.weight.parts[0], lin.screen
    assert screen is not None
    want = kernels.quant_matmul_argmax(part.type, part.data, part.cols, x, lin.act_bytes[0], False, 0.0)
    got = lin.argmax(x, 0.0)
    assert got.tolist() == want.tolist()
    count = screen.candidates
    if count > 0:
        logits = kernels.quant_matmul_checked(part.type, part.data, part.cols, x, None, lin.act_bytes[0])[0]
        rows = screen.cand[:count]
        assert torch.equal(screen.exact[:count], logits[rows].float()), "the candidates' values: the head's"
        assert int(want) in rows.tolist()
        top = logits.float().max()
        assert torch.equal(rows[logits[rows].float() == top], torch.nonzero(logits.float() == top)[:, 0]), (
            "every row tied with the largest is a candidate"
        )
    return count


def rows_x(seed: int, dtype: torch.dtype, scale: float = 1.0, k: int = K) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g) * scale
    x[0, seed % k] *= 20.0  # an outlier channel
    return x.to(dtype)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_random_heads(kernels: cpu_kernels.CpuKernels, qtype: Q, dtype: torch.dtype, threads: int) -> None:
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)  # (the kernels' OpenMP threads too: cpu/backend.py)
        g = torch.Generator().manual_seed(1)
        lin = screened(kernels, blocks(torch.randn(4099, K, generator=g) * 0.05, qtype))
        counts = [check(kernels, lin, rows_x(seed, dtype)) for seed in range(24)]
        assert all(0 < c < 4099 for c in counts), counts  # the screen decided every one
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_wide_rows(kernels: cpu_kernels.CpuKernels, qtype: Q) -> None:
    """k past quant_f16.c's ROW1_PAIR_K (4096), where the full route's one-row tile reads two rows at
    once on AVX-512: the candidates' values (one row at a time) are still its bits."""
    k = 4608
    g = torch.Generator().manual_seed(6)
    lin = screened(kernels, blocks(torch.randn(1030, k, generator=g) * 0.02, qtype))
    for seed in range(6):
        assert check(kernels, lin, rows_x(seed, torch.float32, k=k)) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_ties_and_last_bits(kernels: cpu_kernels.CpuKernels, qtype: Q, dtype: torch.dtype) -> None:
    """The best row copied before and after it (ties: the first index), and copies of it one bit apart
    in one weight (values a float32 step or so apart: the exact tile decides)."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(3000, K, generator=g) * 0.05
    for seed in range(6):
        x = rows_x(100 + seed, dtype)
        best = int(screened(kernels, blocks(w, qtype)).argmax(x, 0.0))
        part = blocks(w, qtype)
        data = part.data.view(torch.int16)
        for at in (3 + seed, best + 1 + seed, 2999 - seed):
            data[at % 3000] = data[best]
        for i, at in enumerate((7 + seed, 1500 + seed, 2990 - seed)):
            data[at] = data[best]
            data[at, (seed * 31 + i * 7) % K] += 1 if i % 2 else -1  # one ulp of one weight
        check(kernels, screened(kernels, part), x)


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_near_copies_whose_int8_order_differs(kernels: cpu_kernels.CpuKernels, qtype: Q) -> None:
    """Rows of one direction with small independent changes: the int8 copy's largest is often not
    the exact largest (checked to happen), and the token is still the exact one."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(K, generator=g) * 0.05
    w = torch.randn(2048, K, generator=g) * 0.05
    w[:512] = base + torch.randn(512, K, generator=g) * 2e-4
    lin = screened(kernels, blocks(w, qtype))
    assert lin.screen is not None
    differs = 0
    for _ in range(16):
        x = (base * 40.0 + torch.randn(K, generator=g) * 0.1)[None].float()
        check(kernels, lin, x)
        differs += int(lin.screen.approx[:2048].argmax()) != int(lin.argmax(x, 0.0))
    assert differs > 0, "the int8 order differed from the exact one somewhere"


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_huge_tiny_zero_and_infinite_x(kernels: cpu_kernels.CpuKernels, qtype: Q) -> None:
    g = torch.Generator().manual_seed(4)
    lin = screened(kernels, blocks(torch.randn(1024, K, generator=g) * 0.05, qtype))
    for scale in (1e30, 1e12, 1e-12, 1e-30, 1e-42):
        check(kernels, lin, rows_x(7, torch.float32, scale))
    assert check(kernels, lin, torch.zeros(1, K)) == 1024, "every row tied: every row a candidate"
    x = rows_x(8, torch.float32)
    x[0, 5] = float("inf")
    assert check(kernels, lin, x) == -1
    x[0, 5] = float("nan")
    assert check(kernels, lin, x) == -1


def test_the_switch_runs_the_full_route(kernels: cpu_kernels.CpuKernels) -> None:
    g = torch.Generator().manual_seed(5)
    lin = screened(kernels, blocks(torch.randn(2048, K, generator=g) * 0.05, Q.BF16))
    switch = ctypes.c_int.in_dll(ctypes.CDLL(str(kernels.path)), "head_screen")
    assert switch.value == 1
    try:
        switch.value = 0
        assert check(kernels, lin, rows_x(9, torch.float32)) == -1
    finally:
        switch.value = 1
    assert check(kernels, lin, rows_x(9, torch.float32)) > 0


def test_non_finite_weights_build_no_screen(kernels: cpu_kernels.CpuKernels) -> None:
    w = torch.randn(64, K) * 0.05
    w[3, 4] = float("inf")
    assert HeadScreen.build(kernels, blocks(w, Q.BF16)) is None


def test_which_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    big, small = blocks(torch.zeros(32768, 32), Q.BF16), blocks(torch.zeros(32767, 32), Q.BF16)
    assert screen_mod.screens(big) and not screen_mod.screens(small)
    q8 = QuantBlocks(int(Q.Q8_0), torch.zeros(32768, 34, dtype=torch.uint8), 32)
    assert not screen_mod.screens(q8)
    monkeypatch.setenv(screen_mod.ENV, "0")
    assert not screen_mod.screens(big)


def test_tiny_gpt_oss_draws_the_same_tokens(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny gpt-oss whose untied head is BF16 (as the bench file's), the screen forced on for its
    small vocabulary: a lone greedy request's tokens equal those with the screen off, step by step."""
    from tests.exactness.test_gpt_oss import hf_gpt_oss, tiny_gpt_oss_config
    from tests.exactness.test_moe import runner_for
    from tests.gpt_oss_gguf import write_gpt_oss_gguf

    monkeypatch.setattr(screen_mod, "SCREEN_MIN_ROWS", 1)
    model = hf_gpt_oss(tiny_gpt_oss_config(layers=2, swiglu_limit=7.0), seed=4)
    write_gpt_oss_gguf(tmp_path / "model.gguf", model, gguf.GGMLQuantizationType.MXFP4, head=Q.BF16)
    runner = runner_for(tmp_path, "gguf", dtype="float32", weight_dtype="gguf")
    served: Any = runner.model
    impl = served.lm_head.impl
    assert isinstance(impl, QuantLinear) and impl.screen is not None and runner.head_argmax
    switch = ctypes.c_int.in_dll(ctypes.CDLL(str(impl.kernels.path)), "head_screen")
    sched = MiniScheduler(runner.num_pages, runner.config.page_size)
    prompt = [3, 9, 4, 11, 7]
    tokens = runner.execute(sched.batch([(0, 0, prompt, True, GREEDY)])).token_ids
    decided = 0
    for step in range(12):
        batch = sched.batch([(0, len(prompt) + step, [tokens[0]], True, None)])
        on = runner.execute(batch).token_ids
        decided += impl.screen.candidates > 0
        try:
            switch.value = 0  # the same K/V rewritten with the same values
            off = runner.execute(batch).token_ids
        finally:
            switch.value = 1
        assert on == off == runner.backend.greedy(runner.compute_logits(batch)).tolist(), step
        tokens = on
    assert decided > 0, "the screen decided some steps"


def test_the_head_alone_is_screened(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare's choice of the Linear that may get a screen: the LM head of a greedy-head model, none
    where its logits are soft-capped or its rows split over tensor-parallel ranks."""
    from gpu_worker.backends.cpu.prepare import _screened_head
    from tests.exactness.test_gpt_oss import hf_gpt_oss, tiny_gpt_oss_config
    from tests.exactness.test_moe import runner_for
    from tests.gpt_oss_gguf import write_gpt_oss_gguf

    monkeypatch.setattr(screen_mod, "SCREEN_MIN_ROWS", 1)
    model = hf_gpt_oss(tiny_gpt_oss_config(layers=1, swiglu_limit=7.0), seed=5)
    write_gpt_oss_gguf(tmp_path / "model.gguf", model, gguf.GGMLQuantizationType.MXFP4, head=Q.BF16)
    served: Any = runner_for(tmp_path, "gguf", dtype="float32", weight_dtype="gguf").model
    assert _screened_head(served) is served.lm_head
    screened = [m for m in served.modules() if getattr(getattr(m, "impl", None), "screen", None) is not None]
    assert screened == [served.lm_head]
    monkeypatch.setattr(served, "tensor_parallel", (0, 2))
    assert _screened_head(served) is None
    monkeypatch.setattr(served, "tensor_parallel", None)
    monkeypatch.setattr(served, "head_softcap", 30.0)
    assert _screened_head(served) is None
