"""The shared-memory all-reduce of tensor-parallel ranks: real processes in a real gloo group.

Each rank sums tensors of several sizes (one decode row, a prefill chunk, one larger than a round's
piece, so it takes several rounds) in float32 and float64 through ``ShmAllReduce``; every rank must
get the same bits, equal to the ranks' values summed in rank order, and gloo's sum to rounding.
"""

from __future__ import annotations

import multiprocessing
import socket
from pathlib import Path

import pytest
import torch

from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.kind import requested_kind
from gpu_worker.backends.cpu.shm_allreduce import PIECE_BYTES, ShmAllReduce
from gpu_worker.backends.torch.backend import gloo_all_reduce
from gpu_worker.tensor_parallel import init_group

SIZES = (576, 32 * 576, PIECE_BYTES // 4 * 2 + 123)  # the last: three rounds in float32, five in float64


def rank_values(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + numel)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def _rank(rank: int, world: int, addr: str, library: str, out_dir: str) -> None:
    init_group(rank, world, addr)
    shm = ShmAllReduce(Path(library), rank, world)
    results = {}
    for _ in range(2):  # twice: the counters and pieces are reused from one call to the next
        for numel in SIZES:
            for dtype in (torch.float32, torch.float64):
                shared, gloo = rank_values(rank, numel, dtype), rank_values(rank, numel, dtype)
                shm(shared)
                gloo_all_reduce(gloo)
                results[(numel, str(dtype))] = (shared, gloo)
    torch.save({"results": results, "path": str(shm.path)}, f"{out_dir}/rank{rank}.pt")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_same_sum(world: int, tmp_path: Path) -> None:
    kernels = cpu_kernels.load(requested_kind())
    if kernels is None:
        pytest.skip("no C compiler: the worker uses gloo")
    ctx = multiprocessing.get_context("spawn")
    addr = f"127.0.0.1:{_free_port()}"
    args = (world, addr, str(kernels.path), str(tmp_path))
    procs = [ctx.Process(target=_rank, args=(r, *args)) for r in range(world)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0, f"a rank exited with {p.exitcode}"
    finally:
        for p in procs:  # a rank stuck waiting for a dead one: never left behind
            if p.is_alive():
                p.kill()
                p.join(5)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    assert len({r["path"] for r in ranks}) == 1, "the ranks mapped different regions"
    assert not Path(ranks[0]["path"]).exists(), "the region's file outlived the set-up"
    for (numel, dtype_name), (shared, gloo) in ranks[0]["results"].items():
        dtype = shared.dtype
        expected = torch.zeros(numel, dtype=dtype)
        for r in range(world):
            expected += rank_values(r, numel, dtype)
        assert torch.equal(shared, expected), f"{numel} {dtype_name}: not the rank-order sum"
        for other in ranks[1:]:
            assert torch.equal(other["results"][(numel, dtype_name)][0], shared), "ranks got different bits"
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(shared, gloo, rtol=tol, atol=tol)
