"""The worker's embedding rows: each pooling row's final-norm hidden states, pooled (the last
position, or the sum over the row), one norm call for the batch; a batch without pooling rows
gets nothing."""

from __future__ import annotations

import msgspec
import pytest
import torch

from gpu_worker.pooling import final_norm, pooled_rows
from protocol.embedding import Pooling
from protocol.messages import ForwardBatch
from tests.models import GREEDY

BATCH = ForwardBatch(
    step=1, req_pool_idx=[0, 1, 2], prefix_lens=[0, 0, 4], extend_lens=[3, 2, 1], input_ids=[1] * 6,
    page_starts=[0, 0, 1], page_counts=[1, 1, 0], pages=[3, 4], sample=[False, True, True],
    sampler=[GREEDY, GREEDY, None], pool=[Pooling.MEAN, None, Pooling.LAST],
)  # fmt: skip


def test_pooled_rows_norm_each_position_then_pool() -> None:
    hidden = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    calls: list[int] = []

    def norm(x: torch.Tensor) -> torch.Tensor:
        calls.append(len(x))
        return x * 2

    pooled = pooled_rows(hidden, BATCH, norm)
    assert pooled == [[2 * (0 + 2 + 4), 2 * (1 + 3 + 5)], [20.0, 22.0]] and calls == [4]
    assert pooled_rows(hidden, msgspec.structs.replace(BATCH, pool=[]), norm) == []


def test_final_norm_is_found_on_our_models() -> None:
    norm = torch.nn.LayerNorm(2)
    llama_like = torch.nn.Module()
    llama_like.model = torch.nn.Module()
    llama_like.model.norm = norm
    gpt2_like = torch.nn.Module()
    gpt2_like.transformer = torch.nn.Module()
    gpt2_like.transformer.ln_f = norm
    assert final_norm(llama_like) is norm and final_norm(gpt2_like) is norm
    with pytest.raises(NotImplementedError):
        final_norm(torch.nn.Module())
