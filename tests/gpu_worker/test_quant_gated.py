"""quant.c's gated matmul (quant_matmul_gated): act(x W_gate^T) * (x W_up^T) in one call, each panel's
gate and up columns combined in L1, never writing the [rows, 2 inner] gate|up output. It stands for
quant_matmul of the merged gate|up Linear followed by silu_mul (gelu_tanh_mul), and must give their
bits: every case below compares the one call with those two calls (and with the library's own
unfused route, ``quant_gated`` 0), on every kind this CPU runs, for the 16-bit and 8-bit tiles, both
layouts, float32 and bfloat16, one row to past a tile's row chunk, and gate and up as one merged part
or as two tensors."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.attention import KERNEL_MAX_EXTEND
from gpu_worker.backends.cpu.backend import CpuBackend
from gpu_worker.backends.cpu.kind import CpuKind
from gpu_worker.backends.cpu.layouts import A8, interleave_rows, kernel_type
from gpu_worker.model_runner import ModelRunner
from gpu_worker.models.layers import MergedLinear
from gpu_worker.weights.formats import QuantBlocks
from protocol.messages import ForwardBatch
from tests.gpu_worker.helpers import GREEDY, KINDS, MiniScheduler
from tests.gpu_worker.test_decode_layers import MIXED, ONE_TYPE, make_q4_k_m_llama, runner_of
from tests.gpu_worker.test_gguf_weights import make_random_llama
from tests.gpu_worker.test_quant_k_kernels import activations
from tests.gpu_worker.test_quant_k_kernels import random_blocks as k_blocks
from tests.gpu_worker.test_quant_sub32 import random_blocks as sub32_blocks

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

# (type, inner, k): the 1B IQ4_XS file's gate|up type, the K-quants of Q4_K_M files, the legacy and
# per-32 types (a panel's odd widths: inner 8 past a whole number of 16-column units)
CASES = [
    (Q.IQ4_XS, 72, 512),
    (Q.Q4_K, 40, 256),
    (Q.Q6_K, 24, 512),
    (Q.Q5_K, 16, 256),
    (Q.Q4_0, 40, 64),
    (Q.Q8_0, 24, 96),
    (Q.Q5_0, 24, 64),
    (Q.IQ4_NL, 8, 64),
]
K_QUANTS = frozenset({Q.Q4_K, Q.Q5_K, Q.Q6_K})


@pytest.fixture(scope="module", params=KINDS, ids=[kind.value for kind in KINDS])
def kernels(request: pytest.FixtureRequest) -> cpu_kernels.CpuKernels:
    kind: CpuKind = request.param
    return cpu_kernels.CpuKernels(cpu_kernels.build(kind), kind)


def gate_up(qtype: Q, inner: int, k: int, x8: bool) -> QuantBlocks:
    """Random blocks of a merged [2 inner, k] gate|up weight, its rows interleaved by 8 where ``x8``."""
    seed = inner * 1000 + k + int(qtype)
    if qtype in K_QUANTS:
        data = k_blocks(qtype, 2 * inner, k, seed=seed)
    else:
        data = sub32_blocks(qtype, 2 * inner, k, np.random.default_rng(seed))
    blocks = QuantBlocks(int(qtype), torch.from_numpy(data), k)
    return interleave_rows(blocks) if x8 else blocks


def flag(kernels: cpu_kernels.CpuKernels) -> ctypes.c_int:
    return ctypes.c_int.in_dll(ctypes.CDLL(str(kernels.path)), "quant_gated")  # the loaded library


def unfused(
    kernels: cpu_kernels.CpuKernels, t: int, w: QuantBlocks, x: torch.Tensor, gelu: bool
) -> torch.Tensor:
    """The calls the gated one stands for: the merged Linear's output, then the activation's pass."""
    act_bytes = kernels.quant_check(t & ~A8, w.data, w.cols)
    gu = kernels.quant_matmul_checked(t, w.data, w.cols, x, None, act_bytes)
    return kernels.gelu_tanh_mul(gu) if gelu else kernels.silu_mul(gu)


@pytest.mark.parametrize(("qtype", "inner", "k"), CASES, ids=[f"{t.name}-{n}x{k}" for t, n, k in CASES])
@pytest.mark.parametrize("a8", [False, True], ids=["a16", "a8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_gated_matmul_has_the_unfused_bits(
    kernels: cpu_kernels.CpuKernels, qtype: Q, inner: int, k: int, a8: bool, dtype: torch.dtype
) -> None:
    w = gate_up(qtype, inner, k, x8=a8)
    t = kernel_type(w)
    if a8:
        if not kernels.quant_supported(t | A8):
            pytest.skip(f"{kernels.kind.value} has no 8-bit tile for {qtype.name}")
        t |= A8
    act_bytes = kernels.quant_check(t & ~A8, w.data, w.cols)
    gate, up = w.data[:inner], w.data[inner:]
    switch = flag(kernels)
    for rows in (1, 3, 16, 37, 130) if a8 else (1, 5, 130):
        for gelu in (False, True):
            x = activations(rows, k, rows + inner, dtype)
            want = unfused(kernels, t, w, x, gelu)
            got = kernels.quant_matmul_gated(t, gate, up, k, x, act_bytes, gelu)
            assert got.shape == (rows, inner) and got.dtype == dtype and want.abs().sum() > 0
            assert torch.equal(got, want), f"{rows} rows, gelu {gelu}"
            # gate and up as two tensors (a Linear's two parts), and the library's unfused route
            apart = kernels.quant_matmul_gated(t, gate.clone(), up.clone(), k, x, act_bytes, gelu)
            assert torch.equal(apart, want)
            saved = switch.value
            try:
                switch.value = 0
                assert torch.equal(kernels.quant_matmul_gated(t, gate, up, k, x, act_bytes, gelu), want)
            finally:
                switch.value = saved


def test_gated_matmul_refuses_what_quant_matmul_refuses(kernels: cpu_kernels.CpuKernels) -> None:
    w = gate_up(Q.Q4_0, 8, 64, x8=False)
    x = activations(2, 64, 1, torch.float32)
    with pytest.raises(ValueError, match="RV_ERR_K"):
        kernels.quant_matmul_gated(int(Q.Q4_0), w.data[:8], w.data[8:], 48, x[:, :48], 64, False)


def logits_both_ways(
    runner: ModelRunner, batch: ForwardBatch, switch: ctypes.c_int, step: int
) -> torch.Tensor:
    """The batch's logits with the C switch at 1, then the same batch again at 0 (its K/V rewritten with
    the same values); asserts the two are equal and returns them."""
    both = []
    for value in (1, 0):
        switch.value = value
        try:
            both.append(runner.compute_logits(batch))
        finally:
            switch.value = 1
    assert torch.equal(both[0], both[1]), (step, float((both[0] - both[1]).abs().max()))
    return both[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("weights", ["q4_k_m", "one_type", "mixed"])
def test_a_llama_gives_the_unfused_logits(tmp_path: Path, dtype: str, weights: str) -> None:
    """Through the runner, prefill (the MLP modules: the gate|up Linear's ``silu_mul`` slot) and decode
    steps (the one-call decode's gated MLP) give the logits the unfused calls give (``quant_gated`` 0,
    the same batch run again). Gate and up of one type (the Q4_K_M mix, and ONE_TYPE's Q4_0) take the
    gated call; of two types (MIXED) the Linear's two calls, as before."""
    if weights == "q4_k_m":
        paths = make_q4_k_m_llama(tmp_path)
    else:
        paths = make_random_llama(tmp_path, ONE_TYPE if weights == "one_type" else MIXED)
    runner = runner_of(paths, dtype)
    backend = runner.backend
    assert isinstance(backend, CpuBackend) and backend.kernels is not None
    gate_ups = [m for m in runner.model.modules() if isinstance(m, MergedLinear) and len(m.sizes) == 2]  # type: ignore[attr-defined]
    assert gate_ups and all((m.silu_mul is None) == (weights == "mixed") for m in gate_ups)
    switch = flag(backend.kernels)
    sched = MiniScheduler(runner.num_pages, runner.config.page_size)
    lens = [KERNEL_MAX_EXTEND + 5 + 7 * i for i in range(3)]  # every prompt past the kernel: the modules
    batch = sched.batch([(idx, 0, list(range(3, 3 + n)), True, GREEDY) for idx, n in enumerate(lens)])
    for step in range(4):
        tokens = logits_both_ways(runner, batch, switch, step).float().argmax(dim=-1).tolist()
        batch = sched.batch([(idx, lens[idx] + step, [tokens[idx]], True, None) for idx in range(3)])


def test_a_merged_gate_up_split_inside_a_group_of_8_takes_the_two_calls(tmp_path: Path) -> None:
    """Gate and up of 36 rows each held as one part interleaved by 8 (72 rows): the halves split a
    group of 8 rows, which the gated call refuses (RV_ERR_X8_ROWS). The MLP gets no ``silu_mul`` slot
    and runs the Linear and silu_mul: prompt and decode steps run (the down projection F16, whose 36
    columns keep the modules, not the one-call decode, which takes block multiples only)."""
    paths = make_random_llama(tmp_path, ONE_TYPE | {"ffn_down": Q.F16}, intermediate=36)
    runner = runner_of(paths, "float32")
    gate_ups = [m for m in runner.model.modules() if isinstance(m, MergedLinear) and len(m.sizes) == 2]  # type: ignore[attr-defined]
    assert gate_ups and all(m.impl.weight.parts[0].layout == "x8" and m.silu_mul is None for m in gate_ups)  # type: ignore[union-attr]
    sched = MiniScheduler(runner.num_pages, runner.config.page_size)
    batch = sched.batch([(idx, 0, list(range(3, 3 + n)), True, GREEDY) for idx, n in enumerate((5, 9))])
    tokens = runner.compute_logits(batch).argmax(dim=-1).tolist()
    batch = sched.batch([(idx, n, [tokens[idx]], True, None) for idx, n in enumerate((5, 9))])
    assert runner.compute_logits(batch).isfinite().all()


def q8_flag(kernels: cpu_kernels.CpuKernels) -> ctypes.c_int:
    return ctypes.c_int.in_dll(ctypes.CDLL(str(kernels.path)), "quant_gated_q8")  # the loaded library


# The down projection's 8-bit activations per 32 values (act8_32: IQ4_XS's 256-value blocks, Q5_0's
# 32), beside the Q4_K_M mix's per 256 (act_block8: its Q4_K and Q6_K downs)
DOWN_TYPES = {
    "iq4_xs": ONE_TYPE | {"ffn_gate": Q.IQ4_NL, "ffn_up": Q.IQ4_NL, "ffn_down": Q.IQ4_XS},
    "q5_0": ONE_TYPE | {"ffn_gate": Q.Q5_0, "ffn_up": Q.Q5_0, "ffn_down": Q.Q5_0},
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("weights", ["q4_k_m", "iq4_xs", "q5_0"])
def test_the_down_projection_takes_its_rows_quantized_in_the_gated_panels(
    tmp_path: Path, dtype: str, weights: str
) -> None:
    """The one-call decode at 6 rows, where every layer's down projection meets 8-bit activations (on
    every kind but portable): the gated call writes the down's quantized rows from its panels
    (``quant_gated_q8`` 1, csrc/quant.c's quant_matmul_gated_q8) and gives the logits of its output
    written and quantized by the down's own call (0), the same batch run again, decode after decode."""
    if weights == "q4_k_m":
        paths = make_q4_k_m_llama(tmp_path)
    else:
        paths = make_random_llama(tmp_path, DOWN_TYPES[weights])
    runner = runner_of(paths, dtype)
    backend = runner.backend
    assert isinstance(backend, CpuBackend) and backend.kernels is not None
    rows = 6
    downs = [m.impl for name, m in runner.model.named_modules() if name.endswith("down_proj")]  # type: ignore[attr-defined]
    taken = [d.a8_min_rows[0] <= rows and d.dense_min_rows[0] > rows for d in downs]
    assert downs and all(taken) == (backend.kernels.kind != CpuKind.PORTABLE), taken
    switch = q8_flag(backend.kernels)
    sched = MiniScheduler(runner.num_pages, runner.config.page_size)
    lens = [5 + 3 * i for i in range(rows)]
    prompts = sched.batch([(i, 0, list(range(3, 3 + n)), True, GREEDY) for i, n in enumerate(lens)])
    logits = runner.compute_logits(prompts)
    for step in range(3):
        tokens = logits.float().argmax(dim=-1).tolist()
        batch = sched.batch([(i, lens[i] + step, [tokens[i]], True, None) for i in range(rows)])
        logits = logits_both_ways(runner, batch, switch, step)
