"""The LM head's greedy draw without its logits (csrc/quant.c's quant_matmul_argmax, cpu/quant.py's
QuantLinear.argmax, sampling/head_argmax.py): each row's argmax, folded panel by panel as the head's
kernel computes them, equals the argmax of the logits that kernel writes, soft-capped by
softcap_f32 where there is a cap: the same index, first on ties, for every weight type the head can
have, the integer and the dense paths, 16- and 8-bit activations, float32 and bf16 rows, one
thread and several, on every CPU kind this CPU runs. Ties are built on purpose: the best column of
some rows copied to an earlier and a later column (another thread's, another panel's)."""

from __future__ import annotations

import ctypes
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.layouts import A8, interleave_rows, kernel_type
from gpu_worker.backends.cpu.quant import QuantLinear
from gpu_worker.weights.formats import QuantBlocks, QuantizedWeight
from tests.gpu_worker.test_quant_k_kernels import activations, random_blocks

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

K = 512
TYPES = [Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q4_K, Q.Q6_K, Q.BF16, Q.F16]
CAP = 30.0  # Gemma 4's final soft-cap


def file_blocks(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [n, row bytes] of ``qtype``: gguf-py's quantization of random weights, or random
    K-quant blocks (gguf-py makes none)."""
    if qtype in (Q.Q4_K, Q.Q6_K):
        return random_blocks(qtype, n, k, seed)
    rng = np.random.default_rng(seed)
    blocks = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qtype)
    return np.ascontiguousarray(blocks).view(np.uint8).reshape(n, -1)


def with_ties(blocks: np.ndarray, best: list[int], n: int) -> np.ndarray:
    """``blocks`` with each column in ``best`` copied to an earlier one and to the last ones (the
    same weights: the same logits, so those rows' largest value at two or three columns)."""
    out = blocks.copy()
    for i, c in enumerate(best):
        early, late = (c // 3 + i) % n, n - 1 - i
        if early != c:
            out[early] = blocks[c]
        out[late] = blocks[c]
    return out


def head(kernels: cpu_kernels.CpuKernels, blocks: np.ndarray, qtype: Q, k: int, x8: bool) -> QuantLinear:
    part = QuantBlocks(int(qtype), torch.from_numpy(np.ascontiguousarray(blocks)), k)
    return QuantLinear(QuantizedWeight((interleave_rows(part) if x8 else part,)), None, kernels)


def logits_argmax(
    kernels: cpu_kernels.CpuKernels, lin: QuantLinear, x: torch.Tensor, cap: float, **path: object
) -> torch.Tensor:
    """Today's route: the head's logits (the path ``path`` names, else the Linear's own), soft-capped
    in place by softcap_f32, then the C argmax."""
    if path:
        part, type_code, dense = lin.weight.parts[0], int(path["type"]), bool(path["dense"])  # type: ignore[call-overload]
        logits = kernels.quant_matmul_checked(
            type_code, part.data, part.cols, x, None, lin.act_bytes[0], dense
        )
    else:
        logits = lin(x)
    if cap:
        kernels.softcap_(logits, cap)
    return kernels.argmax(logits)


def paths(kernels: cpu_kernels.CpuKernels, lin: QuantLinear, rows: int) -> list[tuple[int, bool]]:
    """(type code, dense) of every path the C kernels take for this head: 16-bit and (where the
    build has them) 8-bit activations, and the dense path."""
    part = lin.weight.parts[0]
    base = kernel_type(part)
    out = [(base, False), (base, True)]
    a8_fits = part.type == Q.BF16 or part.cols % 256 == 0 or part.type in (Q.Q8_0, Q.Q5_0)
    if a8_fits and kernels.quant_supported(base | A8) and (part.type == Q.BF16 or part.layout != "file"):
        out.append((base | A8, False))
    return out


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
@pytest.mark.parametrize("x8", [False, True], ids=["file", "x8"])
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_argmax_equals_the_logits_argmax(
    kernels: cpu_kernels.CpuKernels, qtype: Q, x8: bool, rows: int
) -> None:
    n = 1000 if not x8 else 1024  # (file layout: not a whole number of 8- or 16-column units)
    x = activations(rows, K, seed=rows + int(qtype), dtype=torch.float32).contiguous()
    plain = head(kernels, file_blocks(qtype, n, K, seed=int(qtype)), qtype, K, x8)
    best = logits_argmax(kernels, plain, x, 0.0).tolist()[:4]
    lin = head(kernels, with_ties(file_blocks(qtype, n, K, seed=int(qtype)), best, n), qtype, K, x8)
    logits = lin(x)
    tied = [(logits[r] == logits[r].max()).sum().item() for r in range(min(rows, 4))]
    assert max(tied) >= 2, "the copied columns tie at the largest logit"
    for cap in (0.0, CAP):
        for type_code, dense in paths(kernels, lin, rows):
            want = logits_argmax(kernels, lin, x, cap, type=type_code, dense=dense)
            part = lin.weight.parts[0]
            got = kernels.quant_matmul_argmax(type_code, part.data, K, x, lin.act_bytes[0], dense, cap)
            assert torch.equal(got, want), (cap, type_code, dense)
        assert torch.equal(lin.argmax(x, cap), logits_argmax(kernels, lin, x, cap))


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q6_K, Q.BF16], ids=["Q8_0", "Q6_K", "BF16"])
def test_threads_merge_by_value_then_lowest_index(
    kernels: cpu_kernels.CpuKernels, qtype: Q, threads: int
) -> None:
    """Several threads (each its own columns, or at few columns a share of the rows too): ties across
    threads resolve to the lowest column, as one pass over the logits does."""
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)  # (the kernels' OpenMP threads too: cpu/backend.py)
        for n, rows in ((4096, 32), (16, 7), (8, 5)):
            x = activations(rows, K, seed=n + rows, dtype=torch.float32).contiguous()
            plain = head(kernels, file_blocks(qtype, n, K, seed=n), qtype, K, True)
            best = logits_argmax(kernels, plain, x, 0.0).tolist()[:3]
            lin = head(kernels, with_ties(file_blocks(qtype, n, K, seed=n), best, n), qtype, K, True)
            part_bytes = lin.act_bytes[0]
            for cap in (0.0, CAP):
                for type_code, dense in paths(kernels, lin, rows):
                    want = logits_argmax(kernels, lin, x, cap, type=type_code, dense=dense)
                    part = lin.weight.parts[0]
                    got = kernels.quant_matmul_argmax(type_code, part.data, K, x, part_bytes, dense, cap)
                    assert torch.equal(got, want), (n, rows, cap, type_code, dense)
    finally:
        torch.set_num_threads(saved)


def test_bf16_rows_round_before_the_argmax(kernels: cpu_kernels.CpuKernels) -> None:
    """bf16 activations: the logits rounded to bf16 (many ties there) and their first largest; a cap
    on bf16 logits is refused (the model caps them in torch: QuantLinear.argmax_fits says no)."""
    n, rows = 2048, 9
    lin = head(kernels, file_blocks(Q.Q8_0, n, K, seed=3), Q.Q8_0, K, True)
    x = activations(rows, K, seed=4, dtype=torch.bfloat16).contiguous()
    logits = lin(x)
    assert logits.dtype == torch.bfloat16
    assert torch.equal(lin.argmax(x, 0.0), kernels.argmax(logits))
    assert torch.equal(lin.argmax(x, 0.0), logits.float().max(dim=-1).indices)
    assert not lin.argmax_fits(rows, torch.bfloat16, CAP) and lin.argmax_fits(rows, torch.float32, CAP)
    part = lin.weight.parts[0]
    with pytest.raises(ValueError, match="RV_ERR_DTYPE"):
        kernels.quant_matmul_argmax(kernel_type(part), part.data, K, x, lin.act_bytes[0], False, CAP)


def test_softcap_at_takes_softcap_f32s_forms(kernels: cpu_kernels.CpuKernels) -> None:
    """A tensor whose size is not a whole number of vectors: its last values take softcap_f32's
    scalar form, the rest the vector form, in whatever pieces the head's panels cut it."""
    total = 3 * 1000 + 13
    values = torch.randn(total, generator=torch.Generator().manual_seed(5)) * 40
    values[::97] = 0.1  # (below the small-argument series' bound)
    whole = values.clone()
    kernels.softcap_(whole, CAP)
    lib = ctypes.CDLL(str(kernels.path))
    i64 = ctypes.c_int64
    lib.softcap_at.argtypes = [ctypes.c_void_p, i64, i64, i64, ctypes.c_float]
    pieces = values.clone()
    at = 0
    for size in (7, 16, 1, 40, 333, 2000, 5, 600, total):
        size = min(size, total - at)
        if size <= 0:
            break
        view = pieces[at : at + size]
        lib.softcap_at(view.data_ptr(), size, at, total, CAP)
        at += size
    assert at == total
    assert torch.equal(pieces, whole)
