"""Latent attention under tensor parallel: each rank keeps 1/N of the heads (q's rows, kv_b's, o's
columns) and of the routed experts, the latent pool whole; two ranks' hidden states equal one rank's
in float64 within rounding (o's and the experts' partial sums add per rank first), through a chunked
prompt (the expanded form over a prefix read from the pool) and decode steps (the absorbed form on the
backend's paged attention). One process: the two ranks run in threads joined by an in-place sum."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from gpu_worker.backends.torch.backend import TorchBackend
from gpu_worker.forward_context import BatchRows, ForwardContext
from gpu_worker.kv_cache import KVPool
from gpu_worker.tensor_parallel import TensorParallel
from gpu_worker.weights.loader import load_model
from tests.mla_models import make_prompts, save_mla_model

PAGE = 4
# (prefix_len, extend_len) of one request's steps: a prompt in chunks of 7 and 5, then decode steps
STEPS = ((0, 7), (7, 5), (12, 1), (13, 1), (14, 1))


class ThreadSum:
    """The ranks' in-place all-reduce, between threads: every rank gets rank 0's part plus rank 1's."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world)
        self.parts: list[torch.Tensor | None] = [None] * world

    def for_rank(self, rank: int) -> Any:
        def all_reduce(t: torch.Tensor) -> None:
            self.parts[rank] = t.clone()
            self.barrier.wait()
            total = torch.stack([p for p in self.parts if p is not None]).sum(0)
            self.barrier.wait()
            t.copy_(total)

        return all_reduce


def _run(model: Any, tokens: list[int], out: list[torch.Tensor]) -> None:
    """Every step's hidden states over a pool of the model's own."""
    backend = TorchBackend(torch.device("cpu"))
    kv = KVPool(num_layers=model.num_layers, kv_heads=model.num_kv_heads, head_dim=model.head_dim,
                num_pages=8, page_size=PAGE, max_requests=1, context_len=64, dtype=torch.float64,
                device=torch.device("cpu"), latent=True)  # fmt: skip
    kv.apply_page_deltas([0], [0], [4], [3, 1, 6, 2])
    with torch.inference_mode():
        for prefix, n in STEPS:
            positions, meta = backend.init_forward_metadata(kv, [0], [prefix], [n])
            rows = BatchRows([0], [prefix], [n], kv.page_table, PAGE)
            ctx = ForwardContext(positions=positions, attn=meta, k_cache=kv.k, v_cache=kv.v, backend=backend,
                                 rows=rows)  # fmt: skip
            out.append(model(torch.tensor(tokens[prefix : prefix + n]), ctx))


def test_two_ranks_equal_one(tmp_path: Path) -> None:
    save_mla_model("v3", tmp_path, seed=4)  # 4 heads, 8 routed experts of which each token takes 2
    tokens = make_prompts(9, (15,))[0]
    whole, _ = load_model(tmp_path, torch.float64, torch.device("cpu"))
    TorchBackend(torch.device("cpu")).prepare_model(whole, torch.float64, None)  # type: ignore[arg-type]
    want: list[torch.Tensor] = []
    _run(whole, tokens, want)
    reduce, outs = ThreadSum(2), [[], []]  # type: ignore[var-annotated]
    threads = []
    for rank in range(2):
        model, _ = load_model(tmp_path, torch.float64, torch.device("cpu"))
        tp = TensorParallel(rank, 2, reduce.for_rank(rank))
        TorchBackend(torch.device("cpu")).prepare_model(model, torch.float64, tp)  # type: ignore[arg-type]
        assert model.num_heads == 2 and model.num_kv_heads == 1
        threads.append(threading.Thread(target=_run, args=(model, tokens, outs[rank])))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for got in outs:
        assert len(got) == len(want)
        for ours, theirs in zip(got, want, strict=True):
            assert (ours - theirs).abs().max() <= 1e-12 * theirs.abs().max()
