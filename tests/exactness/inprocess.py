"""The scheduler core and the model runner joined in one process, without sockets.

The same two objects the processes wrap, driven by the same step the scheduler
loop runs: schedule -> execute -> on_result -> take_outputs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from gpu_worker.model_runner import ModelRunner
from protocol import FinishReq, ForwardBatch, RequestError, TokenBatch, TokenizedRequest, WorkerSampling
from protocol.images import ImageInput
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.scheduler import Scheduler
from tests.models import GREEDY


def generate(
    runner: ModelRunner,
    prompts: list[list[int]],
    new_tokens: int,
    *,
    chunked_prefill_size: int,
    enable_mixed_chunk: bool,
    max_prefill_tokens: int = 4096,
    stop_token_ids: tuple[int, ...] = (),
    sampler: WorkerSampling | list[WorkerSampling] = GREEDY,
    scheduler_overrides: dict[str, Any] | None = None,
    overlap: bool = False,
    batches: list[ForwardBatch] | None = None,
    n: int = 1,
    on_added: Callable[[Scheduler], None] | None = None,
    logprobs: list[list[float]] | None = None,
    on_tokens: Callable[[TokenBatch], list[FinishReq]] | None = None,
    images: list[list[ImageInput]] | None = None,
) -> tuple[list[list[int]], Scheduler]:
    """Greedy outputs of every prompt, served together; returns the drained scheduler too.

    ``sampler``: one for every prompt, or one each. ``scheduler_overrides`` sets other
    SchedulerConfig fields (a ``num_pages`` below the runner's uses only part of its pool,
    e.g. to force eviction and retraction). ``overlap``: the next batch is scheduled
    before the last one's result is in, as the scheduler process does (its decode rows
    then send PENDING). ``batches``, when given, collects every batch sent. ``n``: choices per
    prompt (forking from one prefill); the outputs are then prompt-major, n per prompt. ``on_added``
    sees the scheduler once every request is queued (e.g. to give them other drafts). ``logprobs``,
    when given, collects each request's token logprobs as the outputs' ([] where it did not ask).
    ``on_tokens`` sees every TokenBatch as the tokenizer process does (e.g. a RequestTable matching
    stop strings) and returns its FinishReqs, which the scheduler takes before the next batch is
    scheduled, as its process does when they arrive between two batches. ``images``: each prompt's.
    """
    fields: dict[str, Any] = dict(
        num_pages=runner.num_pages,
        context_len=runner.context_len,
        page_size=runner.config.page_size,
        max_running_requests=runner.config.max_running_requests,
        max_prefill_tokens=max_prefill_tokens,
        chunked_prefill_size=chunked_prefill_size,
        enable_mixed_chunk=enable_mixed_chunk,
        state_checkpoints=runner.state_checkpoints,
    )
    fields.update(scheduler_overrides or {})
    scheduler = Scheduler(SchedulerConfig(**fields))
    samplers = sampler if isinstance(sampler, list) else [sampler] * len(prompts)
    for i, prompt in enumerate(prompts):
        req = TokenizedRequest(
            rid=i * n,
            input_ids=prompt,
            max_new_tokens=new_tokens,
            stop_token_ids=list(stop_token_ids),
            sampler=samplers[i],
            n=n,
            images=images[i] if images is not None else [],
        )
        assert scheduler.add(req) is None, f"request {i} rejected"
    if on_added is not None:
        on_added(scheduler)
    outputs: list[list[int]] = [[] for _ in range(len(prompts) * n)]
    if logprobs is not None:
        logprobs[:] = [[] for _ in outputs]
    in_flight: deque[ForwardBatch] = deque()
    while scheduler.has_work or in_flight:
        while len(in_flight) < (2 if overlap else 1) and (batch := scheduler.schedule()) is not None:
            in_flight.append(batch)
            if batches is not None:
                batches.append(batch)
        assert in_flight, "work is pending but nothing was scheduled"
        scheduler.on_result(runner.execute(in_flight.popleft()))
        for msg in scheduler.take_outputs():
            assert not isinstance(msg, RequestError), msg.message
            assert isinstance(msg, TokenBatch)
            for rid, token, logprob in zip(msg.rids, msg.token_ids, msg.logprobs, strict=True):
                if token >= 0:
                    outputs[rid].append(token)
                    if logprobs is not None and samplers[rid // n].logprobs:
                        logprobs[rid].append(logprob)
            for finish in on_tokens(msg) if on_tokens is not None else []:
                scheduler.abort(finish.rid, finish.reason)
    return outputs, scheduler
