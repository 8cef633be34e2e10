"""The prefix cache on hybrid models stays exact: a hit resumes the recurrent state from a checkpoint
taken exactly where the hit ends (scheduler_proc/state_checkpoints.py), clamped to the deepest one.

One scheduler serves turns one after another (each turn's requests finish before the next comes),
so later turns hit what earlier ones cached: a second chat turn extending the first's prompt and
answer, prompts sharing a long system prompt, and a hit that a page-level match would place past
every checkpoint (it must be clamped back).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from protocol import ForwardBatch, TokenBatch, TokenizedRequest
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.scheduler import Scheduler
from scheduler_proc.state_checkpoints import HybridKVManager
from tests.hybrid_models import hf_greedy, make_prompts, save_hybrid
from tests.models import GREEDY

NEW_TOKENS = 6
PAGE = 4


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("qwen3_5-cache")
    return path, save_hybrid("qwen3_5_text", path)


def in_turns(
    runner: ModelRunner,
    turns: list[list[list[int]]],
    chunk: int,
    batches: list[ForwardBatch],
    new_tokens: int = NEW_TOKENS,
    **extra: Any,
) -> tuple[list[list[list[int]]], Scheduler]:
    """Each turn's prompts served together on one scheduler (overlap on), the turns one after another."""
    fields = dict(num_pages=runner.num_pages, context_len=runner.context_len, page_size=PAGE,
                  max_running_requests=runner.config.max_running_requests, chunked_prefill_size=chunk,
                  enable_mixed_chunk=True, state_checkpoints=runner.state_checkpoints)  # fmt: skip
    scheduler = Scheduler(SchedulerConfig(**{**fields, **extra}))
    outputs: list[list[list[int]]] = []
    rid = 0
    for prompts in turns:
        first = rid
        for prompt in prompts:
            req = TokenizedRequest(
                rid=rid, input_ids=prompt, max_new_tokens=new_tokens, stop_token_ids=[], sampler=GREEDY
            )
            assert scheduler.add(req) is None
            rid += 1
        got: dict[int, list[int]] = {r: [] for r in range(first, rid)}
        in_flight: list[ForwardBatch] = []
        while scheduler.has_work or in_flight:
            while len(in_flight) < 2 and (batch := scheduler.schedule()) is not None:
                in_flight.append(batch)
                batches.append(batch)
            scheduler.on_result(runner.execute(in_flight.pop(0)))
            for msg in scheduler.take_outputs():
                assert isinstance(msg, TokenBatch), msg
                for r, token in zip(msg.rids, msg.token_ids, strict=True):
                    if token >= 0:
                        got[r].append(token)
        outputs.append([got[r] for r in range(first, rid)])
    return outputs, scheduler


def runner_for(path: Path, **extra: Any) -> ModelRunner:
    config = dict(model_path=str(path), dtype="float64", page_size=PAGE, kv_cache_tokens=2048, num_threads=1,
                  max_running_requests=8)  # fmt: skip
    return ModelRunner(WorkerConfig(**{**config, **extra}))


def test_second_chat_turn_resumes_from_the_first(hybrid: tuple[Path, Any]) -> None:
    path, hf = hybrid
    runner = runner_for(path)
    first = make_prompts(3, (45,))
    (answer,) = hf_greedy(hf, first, NEW_TOKENS)
    second = [first[0] + answer + make_prompts(4, (7,))[0]]
    batches: list[ForwardBatch] = []
    got, scheduler = in_turns(runner, [first, second], 16, batches)
    assert isinstance(scheduler.kv, HybridKVManager)
    assert got == [[answer], hf_greedy(hf, second, NEW_TOKENS)]
    loads = [b for b in batches if b.state_load_rows]
    assert len(loads) == 1, "the second turn starts from a checkpoint"
    row = loads[0].state_load_rows[0]
    # The first turn computed its 45 + 5 tokens (its last token never entered the model): the
    # checkpoint at the last page boundary, 48, taken by a decode step.
    assert loads[0].prefix_lens[row] == 48
    scheduler.kv.check_checkpoints()


@pytest.mark.parametrize("dtype", ["float64", "float32"])  # float32: the CPU kernels' pooled path
def test_shared_system_prompt_and_a_clamped_hit(hybrid: tuple[Path, Any], dtype: str) -> None:
    path, hf = hybrid
    runner = runner_for(path, dtype=dtype)
    (system,) = make_prompts(5, (70,))
    tails = make_prompts(6, (3, 9, 5))
    # The first turn computes the system prompt in chunks of 16 (checkpoints at 16, 32, 48, 64 and at
    # 72 when its first decode step crosses the page). The second turn's prompts share its first 70
    # tokens then differ: a page match reaches 68, a checkpoint only 64.
    turns = [[system + tails[0]], [system + t for t in tails[1:]]]
    batches: list[ForwardBatch] = []
    got, scheduler = in_turns(runner, turns, 16, batches)
    assert got == [hf_greedy(hf, prompts, NEW_TOKENS) for prompts in turns]
    loads = [(b.prefix_lens[row], b.req_pool_idx[row]) for b in batches for row in b.state_load_rows]
    assert [prefix for prefix, _ in loads] == [64, 64], "both hits clamped from 68 to the checkpoint at 64"
    assert scheduler.kv.available_pages == scheduler.config.num_pages, "pages leaked"
    assert isinstance(scheduler.kv, HybridKVManager)
    scheduler.kv.check_checkpoints()


def test_eviction_and_retraction_with_few_checkpoints(hybrid: tuple[Path, Any]) -> None:
    """A tiny KV pool (prefixes evicted with their checkpoints, requests retracted and recomputed from
    their own checkpoints) and 5 checkpoints in all: hits get shorter, never wrong."""
    path, hf = hybrid
    runner = runner_for(path, state_checkpoints=5)
    first = make_prompts(9, (30, 41, 25, 36))
    turns = [first, [p + t for p, t in zip(first, make_prompts(10, (5, 2, 9, 4)), strict=True)]]
    batches: list[ForwardBatch] = []
    got, scheduler = in_turns(runner, turns, 16, batches, 12, num_pages=40, schedule_conservativeness=0.2)
    assert got == [hf_greedy(hf, prompts, 12) for prompts in turns]
    assert scheduler.num_retracted > 0, "the tiny pool must force retraction"
    assert any(b.state_load_rows for b in batches), "some hit resumed from a checkpoint"
    assert scheduler.kv.available_pages == scheduler.config.num_pages, "pages leaked"
    assert isinstance(scheduler.kv, HybridKVManager)
    scheduler.kv.check_checkpoints()
