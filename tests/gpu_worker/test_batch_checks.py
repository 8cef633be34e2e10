"""Every ForwardBatch rule (gpu_worker/batch_checks.py) refuses a batch that breaks it, with its
message, before the forward: the model never runs, the page table and the per-request sampling
state stay as they were, and the runner serves the next well-formed batch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch

from gpu_worker.batch_checks import BatchError, BatchLimits, check_batch
from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from protocol.embedding import Pooling
from protocol.messages import PENDING, ForwardBatch
from protocol.sampling import WorkerGrammar, WorkerPenalties
from tests.gpu_worker.helpers import GREEDY, VOCAB, save_tiny_model

# Two rows (req_pool_idx 0 and 1, one page each) and a fork of row 0 (req_pool_idx 2) that gets its
# own copy of page 2. The runner below has 4 req_pool_idx, 8 pages of 8 tokens, a context of 64 (the
# pool's 64 tokens bound the model's 256).
BASE = ForwardBatch(
    step=1, req_pool_idx=[0, 1], prefix_lens=[0, 0], extend_lens=[3, 2], input_ids=[3, 4, 5, 6, 7],
    page_starts=[0, 0], page_counts=[1, 1], pages=[2, 3], sample=[True, True], sampler=[GREEDY, GREEDY],
    fork_rows=[0], fork_req_pool_idx=[2], fork_samplers=[GREEDY], copy_src=[2], copy_dst=[4],
)  # fmt: skip
PENALIZED = msgspec.structs.replace(GREEDY, penalties=WorkerPenalties(prompt_len=4, presence=1.0))
LOGPROBS = msgspec.structs.replace(GREEDY, logprobs=True)


def penalties(**fields: Any) -> Any:
    return msgspec.structs.replace(GREEDY, penalties=WorkerPenalties(prompt_len=3, **fields))


def grammar_stops(ids: list[int]) -> Any:
    return msgspec.structs.replace(
        GREEDY, grammar=WorkerGrammar(key="k", compiled="", stop_token_ids=ids, prompt_len=3)
    )


def no_forks(**change: Any) -> dict[str, Any]:
    return {"fork_rows": [], "fork_req_pool_idx": [], "fork_samplers": [], **change}


# (what changes in BASE, the message it is refused with), at least one per rule, in rule order.
BROKEN: list[tuple[dict[str, Any], str]] = [
    ({"prefix_lens": [0]}, "row fields must all have 2 > 0 entries"),
    ({"pool": [Pooling.LAST]}, "pool has 1 entries for 2 rows (one per row, or none)"),
    ({"draft_lens": [0]}, "draft_lens has 1 entries for 2 rows"),
    ({"prefix_ids": [[]]}, "prefix_ids has 1 entries for 2 rows"),
    ({"prompt_logprob_lens": [1], "prompt_logprob_targets": [4]}, "prompt_logprob_lens has 1 entries"),
    ({"input_ids": [3, 4, 5, 6]}, "input_ids / pages do not match extend_lens / page_counts"),
    ({"prompt_logprob_targets": [4]}, "prompt_logprob_targets without prompt_logprob_lens"),
    ({"prompt_logprob_lens": [1, 0]}, "prompt_logprob_targets must hold sum(prompt_logprob_lens) ids"),
    ({"fork_req_pool_idx": []}, "fork fields must all have 1 entries"),
    ({"copy_dst": []}, "copy_src and copy_dst must pair up"),
    ({"req_pool_idx": [0, 0]}, "req_pool_idx must be distinct and in [0, 4)"),
    ({"req_pool_idx": [0, 4]}, "req_pool_idx must be distinct and in [0, 4)"),
    ({"extend_lens": [5, 0]}, "extend_lens must be >= 1 and prefix_lens >= 0"),
    ({"prefix_lens": [-1, 0]}, "extend_lens must be >= 1 and prefix_lens >= 0"),
    ({"prefix_lens": [0, 63]}, "a row runs past the context length 64"),
    ({"page_starts": [0, 8]}, "page deltas outside [0, 8)"),
    ({"page_counts": [2, -1], "pages": [2]}, "page deltas outside [0, 8)"),
    ({"pages": [2, 8]}, "pages must be in [0, 8)"),
    ({"input_ids": [3, 4, 5, 6, VOCAB]}, f"token ids must be in [0, {VOCAB}) or PENDING"),
    ({"input_ids": [3, PENDING, 5, 6, 7]}, "PENDING may only be a row's last token"),
    ({"prefix_lens": [4, 0], "sampler": [PENALIZED, GREEDY]}, "rows [0] give a request penalties"),
    ({"prefix_lens": [4, 0], "sampler": [PENALIZED, GREEDY], "prefix_ids": [[1, 2], []]},
     "row 0 has 2 prefix_ids, expected 4"),
    ({"prefix_lens": [0, 4], "prefix_ids": [[], [1, 2, 3, 4]]}, "row 1 has 4 prefix_ids, expected 0"),
    ({"prefix_lens": [4, 0], "sampler": [PENALIZED, GREEDY], "prefix_ids": [[1, 2, 3, VOCAB], []]},
     f"prefix_ids must be in [0, {VOCAB})"),
    ({"sampler": [msgspec.structs.replace(LOGPROBS, top_logprobs=21), GREEDY]},
     "top_logprobs must be in [0, 20], with logprobs"),
    ({"fork_samplers": [msgspec.structs.replace(GREEDY, top_logprobs=2)]},
     "top_logprobs must be in [0, 20], with logprobs"),
    ({"sampler": [penalties(bias_ids=[1], bias_values=[]), GREEDY]}, "bias_ids and bias_values must pair up"),
    ({"sampler": [penalties(bias_ids=[VOCAB], bias_values=[1.0]), GREEDY]}, "bias, min_tokens and grammar"),
    ({"sampler": [GREEDY, penalties(min_tokens=1, min_tokens_ids=[-1])]}, "stop ids must be in [0, 500)"),
    ({"sampler": [grammar_stops([VOCAB]), GREEDY]}, "bias, min_tokens and grammar stop ids"),
    ({"prompt_logprob_lens": [4, 0], "prompt_logprob_targets": [4] * 4}, "must be in [0, extend_lens]"),
    ({"prompt_logprob_lens": [1, 0], "prompt_logprob_targets": [VOCAB]},
     f"prompt_logprob_targets must be in [0, {VOCAB})"),
    ({"fork_rows": [2]}, "a fork's row must be a sampling row of the batch"),
    ({"sample": [True, False], "fork_rows": [1]}, "a fork's row must be a sampling row of the batch"),
    ({"fork_req_pool_idx": [1]}, "fork_req_pool_idx must be distinct, in [0, 4) and rowless"),
    ({"fork_req_pool_idx": [4]}, "fork_req_pool_idx must be distinct, in [0, 4) and rowless"),
    ({"fork_rows": [0, 0], "fork_req_pool_idx": [2, 2], "fork_samplers": [GREEDY] * 2}, "must be distinct"),
    ({"copy_src": [2, 3], "copy_dst": [4, 4]}, "a page is copied into twice"),
    ({"copy_dst": [2]}, "a page is both copied and copied into"),
    ({"copy_dst": [8]}, "copied pages must be in [0, 8)"),
    (no_forks(draft_lens=[3, 0]), "row 0 drafts 3 of 3 tokens"),
    (no_forks(draft_lens=[0, 1], sample=[True, False]), "row 1 drafts but does not sample"),
    (no_forks(draft_lens=[0, 1], input_ids=[3, 4, 5, 6, PENDING]), "verify row 1 has a PENDING input"),
    ({"draft_lens": [1, 0]}, "verify row 0 has forks"),
    (no_forks(draft_lens=[1, 0], pool=[Pooling.LAST, None]), "pooling rows [0] have drafts"),
    ({"req_pool_idx": [0, 3], "sampler": [GREEDY, None]}, "req_pool_idx [3] sample without sampler settings"),
    ({"rope_offsets": [0]}, "rope_offsets has 1 entries for 2 rows"),
    ({"image_rows": [0]}, "image_rows / state_load_ids must pair up"),
    ({"state_load_rows": [0]}, "image_rows / state_load_ids must pair up"),
    ({"state_save_rows": [0], "state_save_lens": [1]}, "state_save_rows, state_save_lens and state_save_ids"),
    ({"state_load_rows": [2], "state_load_ids": [0]}, "must be rows of the batch, in [0, 2)"),
    ({"state_save_rows": [1], "state_save_lens": [3], "state_save_ids": [0]}, "state_save_lens must be in"),
]  # fmt: skip


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelRunner]:
    path = tmp_path_factory.mktemp("batch_checks") / "model"
    save_tiny_model("llama", False, path)
    config = WorkerConfig(model_path=str(path), dtype="float64", kv_cache_tokens=64, page_size=8,
                          max_running_requests=4, num_threads=1)  # fmt: skip
    yield ModelRunner(config)


@pytest.fixture
def forwards(runner: ModelRunner) -> Iterator[list[int]]:
    """The model forwards run while a test runs (a hook on the real model, which stays intact)."""
    calls: list[int] = []
    model = runner.model
    assert isinstance(model, torch.nn.Module), "our models are nn.Modules"
    hook = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    yield calls
    hook.remove()


def test_the_limits_are_the_runners(runner: ModelRunner) -> None:
    limits = runner.batch_limits
    assert (limits.max_requests, limits.pages_per_request, limits.num_pages) == (4, 8, 8)
    assert (limits.context_len, limits.vocab_size, limits.why_no_pooling) == (64, VOCAB, None)


@pytest.mark.parametrize(("change", "message"), BROKEN, ids=[m for _, m in BROKEN])
def test_a_batch_breaking_a_rule_is_refused_before_its_forward(
    runner: ModelRunner, forwards: list[int], change: dict[str, Any], message: str
) -> None:
    page_table = runner.kv.page_table.clone()
    assigned = list(runner.sampler_params.assigned)
    with pytest.raises(BatchError) as refused:
        runner.execute(msgspec.structs.replace(BASE, **change))
    assert str(refused.value).startswith("batch 1: ") and message in str(refused.value)
    assert forwards == [], "the model ran"
    assert torch.equal(runner.kv.page_table, page_table), "the page table took the batch's deltas"
    assert runner.sampler_params.assigned == assigned, "the sampling state took the batch's settings"


def test_the_runner_serves_well_formed_batches_after_refusing_bad_ones(
    runner: ModelRunner, forwards: list[int]
) -> None:
    with pytest.raises(BatchError, match="pool has 1 entries"):
        runner.execute(msgspec.structs.replace(BASE, pool=[Pooling.LAST]))
    result = runner.execute(msgspec.structs.replace(BASE, pool=[Pooling.MEAN, None]))
    assert result.error is None and len(result.token_ids) == 3, "two rows and a fork draw"
    assert len(result.pooled) == 1 and len(result.pooled[0]) == runner.hf_config.hidden_size
    assert forwards == [1]


def test_a_model_that_cannot_pool_refuses_pooling_rows() -> None:
    limits = BatchLimits(max_requests=4, pages_per_request=32, num_pages=8, context_len=256,
                         vocab_size=VOCAB, why_no_pooling="no final norm")  # fmt: skip
    check_batch(BASE, limits, [False] * 4)  # no row pools: nothing asked of the model
    with pytest.raises(BatchError, match=r"rows \[1\] pool, but the model cannot: no final norm"):
        check_batch(msgspec.structs.replace(BASE, pool=[None, Pooling.LAST]), limits, [False] * 4)
