"""Top-N and prompt logprobs of the engine (scheduler core + model runner) equal HF's float64
``log_softmax`` of the same random model's logits, within TOLERANCE.

A float64 model on both sides: what differs is only the order of floating-point operations
(paged attention, fused kernels), far below 1e-9 in logprob on these 2-layer models; 1e-8 is
the stated tolerance. Prompts go through chunked prefill (several chunk sizes, mixed batches
or not), and a prompt whose prefix is already cached still gets every position.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from protocol.logprobs import PromptLogprobs, TopTokens
from protocol.messages import FinishReason, RequestError, TokenBatch, TokenizedRequest
from protocol.sampling import WorkerSampling
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.scheduler import Scheduler
from tests.models import VOCAB, save_tiny_model

TOLERANCE = 1e-8
TOP_N = 20
PROMPT_LENS = (1, 2, 9, 23, 40)


@dataclass
class Served:
    """What the scheduler sent the tokenizer for one request."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[TopTokens] = field(default_factory=list)
    prompt: PromptLogprobs | None = None
    finish: FinishReason | None = None
    cached_tokens: int = 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("llama-logprobs")
    return path, save_tiny_model("llama", False, path)


def _runner(path: Path) -> ModelRunner:
    return ModelRunner(
        WorkerConfig(model_path=str(path), dtype="float64", page_size=4, kv_cache_tokens=1024, num_threads=1)
    )


def _scheduler(runner: ModelRunner, chunk: int, mixed: bool) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_pages=runner.num_pages,
            context_len=runner.context_len,
            page_size=runner.config.page_size,
            max_running_requests=runner.config.max_running_requests,
            chunked_prefill_size=chunk,
            enable_mixed_chunk=mixed,
        )
    )


def _request(
    rid: int, prompt: list[int], max_new: int, *, top: int, prompt_logprobs: bool
) -> TokenizedRequest:
    sampler = WorkerSampling(
        temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=rid, logprobs=True, top_logprobs=top
    )
    return TokenizedRequest(
        rid=rid,
        input_ids=prompt,
        max_new_tokens=max_new,
        stop_token_ids=[],
        sampler=sampler,
        prompt_logprobs=prompt_logprobs,
    )


def serve(runner: ModelRunner, scheduler: Scheduler, reqs: list[TokenizedRequest]) -> dict[int, Served]:
    """Run ``reqs`` to the end through the scheduler core and the runner, as the processes do."""
    for req in reqs:
        assert scheduler.add(req) is None, f"request {req.rid} rejected"
    served = {req.rid: Served() for req in reqs}
    while scheduler.has_work:
        batch = scheduler.schedule()
        assert batch is not None, "work is pending but nothing was scheduled"
        scheduler.on_result(runner.execute(batch))
        for msg in scheduler.take_outputs():
            assert not isinstance(msg, RequestError), msg.message
            assert isinstance(msg, TokenBatch)
            for lp in msg.prompt_logprobs:
                assert served[lp.rid].prompt is None, "prompt logprobs sent twice"
                served[lp.rid].prompt = lp
            for i, rid in enumerate(msg.rids):
                out = served[rid]
                out.cached_tokens = msg.cached_tokens[i]
                out.finish = msg.finished[i] or out.finish
                if msg.token_ids[i] >= 0:
                    out.tokens.append(msg.token_ids[i])
                    out.logprobs.append(msg.logprobs[i])
                    if msg.top_logprobs:
                        out.top.append(msg.top_logprobs[i])
    return served


def hf_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float64: row p is log_softmax of HF's logits at position p."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().log_softmax(-1)


def _check_top(top: TopTokens, reference: torch.Tensor, n: int) -> None:
    values, ids = reference.topk(n)
    assert top.token_ids == ids.tolist()
    assert torch.allclose(torch.tensor(top.logprobs, dtype=torch.float64), values, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("chunk", [5, -1])
def test_generated_top_logprobs_match_hf(tiny: tuple[Path, Any], chunk: int) -> None:
    path, model = tiny
    runner = _runner(path)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    # Rows that ask for top-N (N varies by row) share batches with rows that ask for none.
    reqs = [
        _request(i, p, 6, top=(0, 1, 5, TOP_N)[i % 4], prompt_logprobs=False) for i, p in enumerate(prompts)
    ]
    served = serve(runner, _scheduler(runner, chunk, mixed=True), reqs)
    for req in reqs:
        out = served[req.rid]
        assert len(out.tokens) == 6 and out.finish is FinishReason.LENGTH
        reference = hf_logprobs(model, req.input_ids + out.tokens)[len(req.input_ids) - 1 : -1]
        assert out.tokens == reference.argmax(-1).tolist(), "greedy: the likeliest token each step"
        chosen = reference.gather(1, torch.tensor(out.tokens)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(out.logprobs, dtype=torch.float64), chosen, atol=TOLERANCE, rtol=0)
        n = req.sampler.top_logprobs
        if n == 0:
            assert all(not t.token_ids for t in out.top), "a request that asked for none gets none"
            continue
        assert len(out.top) == 6, "every token of a request that asked has its top-N"
        for step, top in enumerate(out.top):
            _check_top(top, reference[step], n)
            assert top.token_ids[0] == out.tokens[step] and top.logprobs[0] == out.logprobs[step], (
                "greedy: the chosen token heads its top-N, with the bit-identical logprob"
            )


@pytest.mark.parametrize("chunk", [3, 16, -1])
@pytest.mark.parametrize("mixed", [False, True], ids=["alternate", "mixed"])
@pytest.mark.parametrize("max_new", [0, 1, 3])
def test_prompt_logprobs_match_hf(tiny: tuple[Path, Any], chunk: int, mixed: bool, max_new: int) -> None:
    path, model = tiny
    runner = _runner(path)
    scheduler = _scheduler(runner, chunk, mixed)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    # First the same prompts without prompt logprobs: their pages fill the prefix cache...
    warm = serve(runner, scheduler, [_request(100 + i, p, 2, top=0, prompt_logprobs=False)
                                      for i, p in enumerate(prompts)])  # fmt: skip
    assert all(len(out.tokens) == 2 for out in warm.values())
    again = serve(runner, scheduler, [_request(200, prompts[-1], 1, top=0, prompt_logprobs=False)])
    assert again[200].cached_tokens > 0, "the cache must hold these prompts for the test to mean anything"
    # ...which the prompt-logprob requests must not skip.
    reqs = [
        _request(i, p, max_new, top=(0, 2, TOP_N)[i % 3], prompt_logprobs=True) for i, p in enumerate(prompts)
    ]
    served = serve(runner, scheduler, reqs)
    for req in reqs:
        out = served[req.rid]
        n, prompt = req.sampler.top_logprobs, req.input_ids
        assert out.prompt is not None and out.cached_tokens == 0
        assert out.finish is FinishReason.LENGTH and len(out.tokens) == max_new
        reference = hf_logprobs(model, prompt)
        expected = reference[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
        assert len(out.prompt.logprobs) == len(prompt) - 1
        got = torch.tensor(out.prompt.logprobs, dtype=torch.float64)
        assert torch.allclose(got, expected, atol=TOLERANCE, rtol=0)
        assert len(out.prompt.top) == (len(prompt) - 1 if n else 0)
        for position, top in enumerate(out.prompt.top):
            _check_top(top, reference[position], n)
    assert scheduler.kv.used_tokens == 0, "every page is free (or cached) once all requests finished"
