"""quant.c's streaming stores: an output of STREAM_BYTES or more (float32, no residual; a many-row
head's logits) goes to memory by streaming stores of whole lines instead of memcpy. The bits are the
tiles' either way: the same call with ``quant_y_stream`` off and on (an int the library exports)
gives equal outputs, on every kind this CPU runs: the 8-bit activations' tiles (16-column units,
whole lines: the path that streams) and the 16-bit ones (8-column units: never streamed) alike."""

from __future__ import annotations

import ctypes
import shutil

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.kind import CpuKind
from gpu_worker.backends.cpu.layouts import A8, interleave_rows, kernel_type
from gpu_worker.weights.formats import QuantBlocks
from tests.gpu_worker.helpers import KINDS
from tests.gpu_worker.test_quant_k_kernels import activations, random_blocks

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

STREAM_BYTES = 24 << 20  # csrc/quant.c's
K = 256  # one block a row: the weights stay small while the output passes STREAM_BYTES


@pytest.fixture(scope="module", params=KINDS, ids=[kind.value for kind in KINDS])
def kernels(request: pytest.FixtureRequest) -> cpu_kernels.CpuKernels:
    kind: CpuKind = request.param
    return cpu_kernels.CpuKernels(cpu_kernels.build(kind), kind)


def stream_flag(kernels: cpu_kernels.CpuKernels) -> ctypes.c_int:
    return ctypes.c_int.in_dll(ctypes.CDLL(str(kernels.path)), "quant_y_stream")  # the loaded library


def both_ways(kernels: cpu_kernels.CpuKernels, call: object) -> tuple[torch.Tensor, torch.Tensor]:
    """call() with the streaming stores off, then on (restored after)."""
    flag = stream_flag(kernels)
    saved = flag.value
    try:
        flag.value = 0
        off = call()  # type: ignore[operator]
        flag.value = 1
        on = call()  # type: ignore[operator]
    finally:
        flag.value = saved
    return off, on


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=["Q4_K", "Q6_K"])
@pytest.mark.parametrize("a8", [False, True], ids=["a16", "a8"])
def test_a_large_output_has_the_same_bits_streamed(
    kernels: cpu_kernels.CpuKernels, qtype: Q, a8: bool
) -> None:
    rows, n = 32, STREAM_BYTES // 4 // 32 + 4096  # past the threshold, a whole number of 16-column units
    blocks = QuantBlocks(int(qtype), torch.from_numpy(random_blocks(qtype, n, K, seed=n + int(qtype))), K)
    t = int(qtype)
    if a8:
        blocks = interleave_rows(blocks)
        if not kernels.quant_supported(kernel_type(blocks) | A8):
            pytest.skip(f"{kernels.kind.value} has no 8-bit tile for {qtype.name}")
        t = kernel_type(blocks) | A8
    x = activations(rows, K, 7, torch.float32)
    off, on = both_ways(kernels, lambda: kernels.quant_matmul(t, blocks.data, K, x))
    assert off.shape == (rows, n) and off.abs().sum() > 0
    assert torch.equal(off, on)
    # a few rows alone (an output under the threshold, never streamed) are the same rows' bits
    assert torch.equal(kernels.quant_matmul(t, blocks.data, K, x[5:7]), on[5:7])
