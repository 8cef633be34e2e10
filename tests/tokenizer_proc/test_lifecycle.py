"""Frontend/RequestTable additions for the HTTP API: draining, clients that vanish, engine stats,
serving metrics on a fake clock, and their Prometheus rendering."""

from __future__ import annotations

import asyncio
import random
from typing import TYPE_CHECKING

import pytest

from protocol.messages import (
    EngineStats,
    FinishReason,
    FinishReq,
    GenerateRequest,
    RequestError,
    SamplingParams,
    TokenBatch,
    TokenizedRequest,
)
from tokenizer_proc.frontend import Frontend
from tokenizer_proc.intake import SHUTTING_DOWN
from tokenizer_proc.metrics import Histogram, render_prometheus
from tokenizer_proc.model_info import ModelInfo
from tokenizer_proc.validation import CONTEXT_LENGTH_EXCEEDED, RequestRejected, validate_generate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@pytest.fixture
def frontend(tokenizer: PreTrainedTokenizerBase, model_info: ModelInfo) -> Frontend:
    return Frontend(tokenizer, model_info, seed=0)


def _admit(frontend: Frontend, client: bytes, rid: str) -> TokenizedRequest:
    (req,) = asyncio.run(frontend.admit(client, GenerateRequest(rid=rid, prompt="Hello"))).to_scheduler
    assert isinstance(req, TokenizedRequest)
    return req


def test_draining_refuses_new_requests_with_a_code(frontend: Frontend) -> None:
    frontend.draining = True
    with pytest.raises(RequestRejected) as exc:
        _admit(frontend, b"c", "r")
    assert exc.value.code == SHUTTING_DOWN and len(frontend.requests) == 0


def test_a_vanished_client_loses_all_its_requests_and_only_its(frontend: Frontend) -> None:
    mine = [_admit(frontend, b"gone", rid).rid for rid in ("a", "b")]
    other = _admit(frontend, b"stays", "a").rid
    out = frontend.client_gone(b"gone")
    assert sorted(msg.rid for msg in out.to_scheduler if isinstance(msg, FinishReq)) == sorted(mine)
    assert all(reply.finish_reason is FinishReason.ABORT for _, reply in out.replies)
    assert frontend.requests.client_ids() == {b"stays"} and len(frontend.requests) == 1
    assert frontend.client_gone(b"gone").to_scheduler == []  # nothing left to abort
    assert other not in mine


def test_errors_for_the_choices_of_one_request_name_each_choice(frontend: Frontend) -> None:
    """A forward failure ends each of n choices with one error reply that carries the choice's index;
    so does shutting down. (A reply with index 0 for every choice read as repeated finals.)"""
    request = GenerateRequest(rid="r", prompt="Hello", n=3)
    (req,) = asyncio.run(frontend.admit(b"c", request)).to_scheduler
    assert isinstance(req, TokenizedRequest) and req.n == 3
    failed = frontend.requests.on_request_error(RequestError(rid=req.rid + 2, message="boom"))
    assert [(reply.index, reply.error) for _, reply in failed.replies] == [(2, "boom")]
    rest = frontend.requests.fail_all("shutting down")
    assert sorted(reply.index for _, reply in rest.replies) == [0, 1]


def test_engine_stats_are_kept(frontend: Frontend) -> None:
    assert frontend.engine_stats is None
    stats = EngineStats(num_running=1, num_waiting=2, num_pages=8, free_pages=5)
    assert frontend.on_scheduler_msg(stats).replies == []
    assert frontend.engine_stats == stats


def test_rejections_carry_the_field_and_a_code(
    tokenizer: PreTrainedTokenizerBase, model_info: ModelInfo
) -> None:
    def reject(req: GenerateRequest) -> RequestRejected:
        with pytest.raises(RequestRejected) as exc:
            validate_generate(req, tokenizer, model_info, random.Random(0))
        return exc.value

    bad_top_p = reject(GenerateRequest(rid="r", prompt="x", sampling=SamplingParams(top_p=0)))
    assert (bad_top_p.param, str(bad_top_p)) == (
        "sampling.top_p",
        "sampling.top_p must be in (0, 1], got 0",
    )
    too_long = reject(GenerateRequest(rid="r", input_ids=[5] * model_info.context_len))
    assert (too_long.param, too_long.code) == ("prompt", CONTEXT_LENGTH_EXCEEDED)


def test_token_timing_on_a_fake_clock(tokenizer: PreTrainedTokenizerBase, model_info: ModelInfo) -> None:
    now = [100.0]
    frontend = Frontend(tokenizer, model_info, seed=0, clock=lambda: now[0])
    table = frontend.requests
    rid = _admit(frontend, b"c", "r").rid
    for step, (at, finished) in enumerate([(100.25, None), (100.75, None), (101.0, FinishReason.LENGTH)]):
        now[0] = at
        cached = 3 if step == 0 else 0
        table.on_token_batch(TokenBatch(rids=[rid], token_ids=[7], logprobs=[-1.0], finished=[finished],
                                        cached_tokens=[cached]))  # fmt: skip
    m = table.metrics
    assert (m.ttft_s.count, m.ttft_s.total) == (1, 0.25)
    assert (m.itl_s.count, m.itl_s.total) == (2, 0.75)
    assert (m.e2e_s.count, m.e2e_s.total, m.generation_tokens) == (1, 1.0, 3)
    assert m.finished["length"] == 1 and m.cache_hit_rate == 3 / m.prompt_tokens


def test_histogram_is_cumulative_and_le_inclusive() -> None:
    h = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 7.0):
        h.observe(value)
    lines = h.render("x_seconds", "help")
    assert 'x_seconds_bucket{le="0.1"} 2' in lines and 'x_seconds_bucket{le="1.0"} 3' in lines
    assert 'x_seconds_bucket{le="+Inf"} 4' in lines and "x_seconds_count 4" in lines


def test_prometheus_text_has_engine_state_only_once_known(frontend: Frontend) -> None:
    table = frontend.requests
    before = render_prometheus(table.metrics, None, 0)
    assert "rivulet_kv_pages_free" not in before and "rivulet_generation_tokens_total 0" in before
    stats = EngineStats(
        num_running=2,
        num_waiting=1,
        num_pages=10,
        free_pages=4,
        evictable_pages=2,
        worker_busy_s=12.5,
        worker_clock_s=8001.25,
    )
    text = render_prometheus(table.metrics, stats, 3)
    assert "rivulet_kv_usage_ratio 0.4" in text and "rivulet_num_requests_waiting 1" in text
    assert "rivulet_worker_busy_seconds_total 12.5" in text and "rivulet_worker_clock_seconds 8001.25" in text
    assert 'rivulet_requests_finished_total{finish_reason="abort"} 0' in text
    assert all(line.startswith("#") or len(line.split()) == 2 for line in text.splitlines())
