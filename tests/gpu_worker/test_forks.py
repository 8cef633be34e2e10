"""The worker's forks: page copies that move whole pages of every layer, and draws from copies of their
rows' logits (their fields' rules: test_batch_checks.py)."""

from __future__ import annotations

import msgspec
import torch

from gpu_worker.forks import copy_pages, with_forks
from gpu_worker.kv_cache import KVPool
from protocol.messages import ForwardBatch
from tests.models import GREEDY

BASE = ForwardBatch(
    step=1, req_pool_idx=[0, 1], prefix_lens=[0, 5], extend_lens=[6, 1], input_ids=[1] * 7,
    page_starts=[0, 2], page_counts=[2, 0], pages=[3, 4], sample=[True, False], sampler=[GREEDY, None],
    fork_rows=[0, 0], fork_req_pool_idx=[2, 3], fork_samplers=[GREEDY, GREEDY], copy_src=[4, 4],
    copy_dst=[5, 6],
)  # fmt: skip


def test_copy_pages_copies_every_layer_and_nothing_else() -> None:
    kv = KVPool(num_layers=2, kv_heads=1, head_dim=3, num_pages=4, page_size=2, max_requests=2,
                context_len=8, dtype=torch.float64, device=torch.device("cpu"))  # fmt: skip
    for cache in (*kv.k, *kv.v):
        cache.copy_(torch.randn(cache.shape, dtype=torch.float64))
    before = [cache.clone() for cache in (*kv.k, *kv.v)]
    copy_pages(kv, [1], [3])
    for old, new in zip(before, (*kv.k, *kv.v), strict=True):
        assert torch.equal(new[6:8], old[2:4]), "page 3 holds page 1's rows"
        assert torch.equal(new[:6], old[:6]), "no other page changed"


def test_forks_draw_from_copies_of_their_rows_logits() -> None:
    logits = torch.arange(6.0).view(2, 3)
    batch = msgspec.structs.replace(BASE, sample=[True, True], fork_rows=[1, 0], fork_req_pool_idx=[2, 3])
    out, req_pool_idx, positions = with_forks(logits, [0, 1], [6, 6], [0, 1], batch)
    assert torch.equal(out, torch.cat([logits, logits[[1, 0]]])) and req_pool_idx == [0, 1, 2, 3]
    assert positions == [6, 6, 6, 6]
    out[2, 0] = -1.0
    assert logits[1, 0] == 3.0, "a fork's logits are its own (penalties change them in place)"
