"""Penalties, logit_bias and min_tokens served by the engine (scheduler core + model runner) equal
the reference applied step by step to HF's float64 logits, token for token (greedy).

A tiny random Llama in float64; prompts share long prefixes (so the prefix cache hands
a new req_pool_idx a cached prefix the worker only learns from ``prefix_ids``), chunked prefill, a KV
pool so small that requests are retracted and recomputed, and the overlap scheduler
(decode inputs arrive as PENDING).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from protocol.messages import PENDING, ForwardBatch
from protocol.sampling import WorkerPenalties, WorkerSampling
from tests.exactness import inprocess
from tests.gpu_worker.penalty_reference import greedy
from tests.models import GREEDY, VOCAB, save_tiny_model

NEW_TOKENS = 24
STOP = 77  # the stop id every request has; min_tokens masks it
CONFIGS: list[dict[str, Any] | None] = [
    None,
    dict(presence=-2.0, frequency=0.5),  # the model rarely repeats itself: draw it to
    dict(repetition=1.8),
    dict(repetition=0.7, frequency=0.3),
    dict(bias_ids=[5, 40, 123, STOP], bias_values=[2.5, -100.0, 4.0, -3.0]),
    dict(presence=-0.5, repetition=1.3, bias_ids=[STOP], bias_values=[30.0], min_tokens=4),
]


def prompts_and_penalties() -> tuple[list[list[int]], list[WorkerPenalties | None]]:
    rng = random.Random(5)
    systems = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (40, 70)]
    prompts = [
        rng.choice(systems) + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(10)
    ]
    prompts += [prompts[1], prompts[4]]  # identical prompts, other penalties
    penalties: list[WorkerPenalties | None] = []
    for i, prompt in enumerate(prompts):
        config = CONFIGS[i % len(CONFIGS)]
        if config is None:
            penalties.append(None)
            continue
        stop_ids = [STOP] if config.get("min_tokens") else []
        penalties.append(WorkerPenalties(prompt_len=len(prompt), min_tokens_ids=stop_ids, **config))
    return prompts, penalties


@pytest.fixture(scope="module")
def model_and_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """(model dir, the reference outputs of prompts_and_penalties())."""
    path = tmp_path_factory.mktemp("llama-penalties")
    model = save_tiny_model("llama", False, path)
    prompts, penalties = prompts_and_penalties()

    def next_logits(seq: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([seq])).logits[0, -1].to(torch.float64)

    expected = [
        greedy(next_logits, p, NEW_TOKENS, pen, (STOP,)) for p, pen in zip(prompts, penalties, strict=True)
    ]
    plain = [greedy(next_logits, p, NEW_TOKENS, None, (STOP,)) for p in prompts]
    for i, pen in enumerate(penalties):  # every kind of penalty must change what greedy picks
        if pen is not None:
            assert expected[i] != plain[i], f"prompt {i}: {pen} changes nothing, the test would prove nothing"
    min_tokens = CONFIGS[-1]
    assert min_tokens is not None
    forced = expected[len(CONFIGS) - 1]
    assert len(forced) == min_tokens["min_tokens"] + 1 and forced[-1] == STOP, (
        "STOP comes right after min_tokens"
    )
    return path, expected


def samplers(penalties: list[WorkerPenalties | None]) -> list[WorkerSampling]:
    return [WorkerSampling(**{**_fields(GREEDY), "penalties": p}) for p in penalties]


def _fields(s: WorkerSampling) -> dict[str, Any]:
    return {name: getattr(s, name) for name in s.__struct_fields__}


@pytest.mark.parametrize(
    ("page_size", "mixed", "tiny_pool", "overlap"),
    [(1, False, False, False), (16, True, True, False), (4, True, True, True), (16, False, False, True)],
    ids=["chunked", "cache-retraction", "cache-retraction-overlap", "overlap"],
)
def test_penalties_match_the_reference(
    model_and_reference: tuple[Path, list[list[int]]],
    page_size: int,
    mixed: bool,
    tiny_pool: bool,
    overlap: bool,
) -> None:
    path, expected = model_and_reference
    runner = ModelRunner(
        WorkerConfig(
            model_path=str(path), dtype="float64", page_size=page_size, kv_cache_tokens=2048, num_threads=1
        )
    )
    prompts, penalties = prompts_and_penalties()
    overrides = {"num_pages": 160 // page_size, "schedule_conservativeness": 0.2} if tiny_pool else {}
    batches: list[ForwardBatch] = []
    got, sched = inprocess.generate(
        runner,
        prompts,
        NEW_TOKENS,
        chunked_prefill_size=16,
        enable_mixed_chunk=mixed,
        stop_token_ids=(STOP,),
        sampler=samplers(penalties),
        scheduler_overrides=overrides,
        overlap=overlap,
        batches=batches,
    )
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"prompt {i} ({penalties[i]})"
    if tiny_pool:
        assert sched.num_retracted > 0, "the tiny pool must force retraction"
        assert any(b.prefix_ids for b in batches), (
            "a req_pool_idx with penalties must start from a cached prefix"
        )
    if overlap:
        assert any(PENDING in b.input_ids for b in batches), "overlap must send PENDING decode inputs"
    assert sched.kv.available_pages == sched.config.num_pages, "pages leaked"
