"""The tokenizer process's logic without sockets: client frames and scheduler batches in, messages out."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import pytest

from protocol.logprobs import PromptLogprobs, TopLogprobs, TopTokens
from protocol.messages import (
    AbortRequest,
    EngineStats,
    FinishReason,
    FinishReq,
    GenerateOutput,
    GenerateRequest,
    RequestError,
    SamplingParams,
    TokenBatch,
    TokenizedRequest,
    Usage,
)
from tokenizer_proc.frontend import Frontend
from tokenizer_proc.intake import SHUTDOWN_MESSAGE
from tokenizer_proc.model_info import ModelInfo
from tokenizer_proc.validation import RequestRejected

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CLIENT = b"client-a"


@pytest.fixture
def frontend(tokenizer: PreTrainedTokenizerBase, model_info: ModelInfo) -> Frontend:
    return Frontend(tokenizer, model_info, seed=0)


def _submit(frontend: Frontend, client: bytes = CLIENT, **fields: Any) -> TokenizedRequest:
    sampling = SamplingParams(**fields.pop("sampling", {}))
    fields.setdefault("rid", "r1")
    fields.setdefault("prompt", "Tell me")
    payload = msgspec.msgpack.encode(GenerateRequest(sampling=sampling, **fields))
    out = frontend.on_client_frames([client, payload])
    assert out.replies == [], out.replies
    (req,) = out.to_scheduler
    assert isinstance(req, TokenizedRequest)
    return req


def _usage(reply: GenerateOutput) -> Usage:
    assert reply.usage is not None, f"a final reply carries usage: {reply}"
    return reply.usage


def _row_batch(rid: int, token: int, finished: FinishReason | None = None, cached: int = 0) -> TokenBatch:
    return TokenBatch(
        rids=[rid], token_ids=[token], logprobs=[-0.5], finished=[finished], cached_tokens=[cached]
    )


def _run(frontend: Frontend, rid: int, ids: list[int], last: FinishReason) -> list[GenerateOutput]:
    replies = []
    for i, token in enumerate(ids):
        out = frontend.on_scheduler_msg(_row_batch(rid, token, last if i == len(ids) - 1 else None, cached=3))
        replies += [reply for _, reply in out.replies]
    return replies


def test_streaming_round_trip(frontend: Frontend, tokenizer: PreTrainedTokenizerBase) -> None:
    req = _submit(frontend, stream=True, logprobs=True)
    assert req.input_ids == tokenizer.encode("Tell me") and req.stop_token_ids == [2]
    ids = tokenizer.encode(" about Paris 🗼 and 東京") + [2]
    replies = _run(frontend, req.rid, ids, FinishReason.STOP)
    assert len(replies) == len(ids)  # one reply per row
    assert "".join(r.text for r in replies) == " about Paris 🗼 and 東京"
    assert [t for r in replies for t in r.token_ids] == ids
    assert all(r.logprobs == [-0.5] for r in replies)
    assert [r.finish_reason for r in replies[:-1]] == [None] * (len(ids) - 1)
    final = replies[-1]
    assert final.finish_reason is FinishReason.STOP and final.rid == "r1"
    assert (_usage(final).prompt_tokens, _usage(final).completion_tokens, _usage(final).cached_tokens) == (
        len(req.input_ids),
        len(ids),
        3,
    )
    assert len(frontend.requests) == 0


def test_non_streaming_replies_once(frontend: Frontend, tokenizer: PreTrainedTokenizerBase) -> None:
    req = _submit(frontend)
    ids = tokenizer.encode(" café au lait")
    replies = _run(frontend, req.rid, ids, FinishReason.LENGTH)
    assert len(replies) == 1
    assert (replies[0].text, replies[0].token_ids) == (" café au lait", ids)
    assert replies[0].finish_reason is FinishReason.LENGTH and replies[0].logprobs is None


def test_finish_without_token(frontend: Frontend) -> None:
    req = _submit(frontend, stream=True)
    (reply,) = [r for _, r in frontend.on_scheduler_msg(_row_batch(req.rid, -1, FinishReason.ABORT)).replies]
    assert (reply.token_ids, reply.finish_reason, _usage(reply).completion_tokens) == (
        [],
        FinishReason.ABORT,
        0,
    )


@pytest.mark.parametrize("stream", [True, False])
def test_stop_string(frontend: Frontend, tokenizer: PreTrainedTokenizerBase, stream: bool) -> None:
    req = _submit(frontend, stream=stream, sampling={"stop": ["END"]})
    ids = tokenizer.encode(" one two EN") + tokenizer.encode("D three")
    out_msgs, replies = [], []
    for token in ids:
        out = frontend.on_scheduler_msg(_row_batch(req.rid, token))
        out_msgs += out.to_scheduler
        replies += [r for _, r in out.replies]
    assert out_msgs == [FinishReq(rid=req.rid, reason=FinishReason.STOP)]
    assert "".join(r.text for r in replies) == " one two "
    assert replies[-1].finish_reason is FinishReason.STOP
    assert frontend.on_scheduler_msg(_row_batch(req.rid, 5, FinishReason.ABORT)).replies == []


def test_stop_string_completed_by_the_last_token(
    frontend: Frontend, tokenizer: PreTrainedTokenizerBase
) -> None:
    req = _submit(frontend, sampling={"stop": ["!!"]})
    replies = _run(frontend, req.rid, tokenizer.encode("hi!!"), FinishReason.LENGTH)
    assert (replies[-1].text, replies[-1].finish_reason) == ("hi", FinishReason.STOP)


def test_abort(frontend: Frontend, tokenizer: PreTrainedTokenizerBase) -> None:
    req = _submit(frontend, stream=True)
    frontend.on_scheduler_msg(_row_batch(req.rid, tokenizer.encode(" x")[0]))
    out = frontend.on_client_frames([CLIENT, msgspec.msgpack.encode(AbortRequest(rid="r1"))])
    assert out.to_scheduler == [FinishReq(rid=req.rid, reason=FinishReason.ABORT)]
    ((client, reply),) = out.replies
    assert (client, reply.finish_reason, _usage(reply).completion_tokens) == (CLIENT, FinishReason.ABORT, 1)
    assert frontend.on_scheduler_msg(_row_batch(req.rid, 5)).replies == []  # late rows are ignored
    out = frontend.on_client_frames([CLIENT, msgspec.msgpack.encode(AbortRequest(rid="r1"))])
    assert out.replies[0][1].finish_reason is FinishReason.ERROR and "r1" in (out.replies[0][1].error or "")


def test_malformed_frames_get_error_replies(frontend: Frontend) -> None:
    ((_, reply),) = frontend.on_client_frames([CLIENT, b"\xc1garbage"]).replies
    assert (reply.rid, reply.finish_reason) == ("", FinishReason.ERROR) and "malformed" in (reply.error or "")
    payload = msgspec.msgpack.encode({"type": "generate", "rid": "r9", "prompt": "x", "temprature": 0.5})
    ((_, reply),) = frontend.on_client_frames([CLIENT, payload]).replies
    assert (reply.rid, reply.finish_reason) == ("r9", FinishReason.ERROR) and "temprature" in (
        reply.error or ""
    )
    _submit(frontend)  # still serving


def test_rejected_request_gets_an_error_reply(frontend: Frontend) -> None:
    payload = msgspec.msgpack.encode(
        GenerateRequest(rid="bad", prompt="x", sampling=SamplingParams(top_p=0.0))
    )
    out = frontend.on_client_frames([CLIENT, payload])
    ((_, reply),) = out.replies
    assert out.to_scheduler == [] and reply.rid == "bad" and "sampling.top_p" in (reply.error or "")


def test_the_served_context_bounds_requests(frontend: Frontend, model_info: ModelInfo) -> None:
    """A replica whose KV pool holds fewer tokens than the model's context says so in its EngineStats:
    from then on a request's limit is clamped to that room (a ZMQ client's) or refused over it (an
    HTTP client's own), not sent to a scheduler that could only refuse it; a longer one changes nothing."""
    assert model_info.context_len == 8192
    stats = EngineStats(num_running=0, num_waiting=0, num_pages=4, free_pages=4, context_len=64)
    frontend.on_scheduler_msg(msgspec.structs.replace(stats, context_len=100_000))
    assert frontend.info.context_len == 8192
    frontend.on_scheduler_msg(stats)
    assert frontend.info.context_len == frontend.intake.info.context_len == 64
    req = _submit(frontend, sampling={"max_new_tokens": 1000})
    assert len(req.input_ids) + req.max_new_tokens == 64
    own_limit = GenerateRequest(rid="h", prompt="Tell me", sampling=SamplingParams(max_new_tokens=1000))
    rejected = frontend.intake.begin(CLIENT, own_limit, clamp_to_context=False)
    with pytest.raises(RequestRejected, match="over the context length 64"):
        frontend.intake.start(rejected)


def test_duplicate_rid_is_rejected_per_client(frontend: Frontend) -> None:
    first = _submit(frontend)
    payload = msgspec.msgpack.encode(GenerateRequest(rid="r1", prompt="again"))
    ((_, reply),) = frontend.on_client_frames([CLIENT, payload]).replies
    assert "already in flight" in (reply.error or "")
    second = _submit(frontend, client=b"client-b")  # another client may reuse the rid
    assert second.rid != first.rid


def test_request_error_and_shutdown(frontend: Frontend) -> None:
    a = _submit(frontend)
    _submit(frontend, rid="r2")
    ((_, reply),) = frontend.on_scheduler_msg(RequestError(rid=a.rid, message="too big for KV")).replies
    assert (reply.rid, reply.finish_reason, reply.error) == ("r1", FinishReason.ERROR, "too big for KV")
    ((_, reply),) = frontend.shutdown().replies
    assert (reply.rid, reply.error) == ("r2", SHUTDOWN_MESSAGE)
    assert len(frontend.requests) == 0


def test_rows_of_several_requests_in_one_batch(
    frontend: Frontend, tokenizer: PreTrainedTokenizerBase
) -> None:
    a, b = _submit(frontend, stream=True), _submit(frontend, rid="r2", stream=True)
    x, y = tokenizer.encode(" x")[0], tokenizer.encode(" y")[0]
    batch = TokenBatch(
        rids=[b.rid, 999, a.rid],
        token_ids=[y, 1, x],
        logprobs=[0.0, 0.0, 0.0],
        finished=[FinishReason.LENGTH, None, None],
        cached_tokens=[0, 0, 0],
    )
    replies = {r.rid: r for _, r in frontend.on_scheduler_msg(batch).replies}
    assert replies["r2"].text == " y" and replies["r2"].finish_reason is FinishReason.LENGTH
    assert replies["r1"].text == " x" and replies["r1"].finish_reason is None
    assert len(frontend.requests) == 1


@pytest.mark.parametrize("stop", [[], ["never"]])
def test_non_streaming_abort_returns_the_text_so_far(
    frontend: Frontend, tokenizer: PreTrainedTokenizerBase, stop: list[str]
) -> None:
    req = _submit(frontend, sampling={"stop": stop})
    ids = tokenizer.encode(" so far so good")
    for token in ids:
        assert frontend.on_scheduler_msg(_row_batch(req.rid, token)).replies == []
    ((_, reply),) = frontend.on_client_frames(
        [CLIENT, msgspec.msgpack.encode(AbortRequest(rid="r1"))]
    ).replies
    assert (reply.text, reply.token_ids, reply.finish_reason) == (" so far so good", ids, FinishReason.ABORT)


def test_echo_with_prompt_and_top_logprobs(frontend: Frontend, tokenizer: PreTrainedTokenizerBase) -> None:
    req = _submit(
        frontend, prompt=None, input_ids=[10, 11, 12], echo=True, logprobs=True, top_logprobs=2, stream=True
    )
    assert req.prompt_logprobs and req.sampler.top_logprobs == 2
    top = [TopTokens([7, 8], [-0.1, -2.5]), TopTokens([9, 10], [-0.2, -1.9])]
    prompt = PromptLogprobs(rid=req.rid, logprobs=[-3.0, -4.0], top=top)
    alternatives = [TopTokens([13, 14], [-0.7, -0.9])]
    batch = TokenBatch(rids=[req.rid], token_ids=[13], logprobs=[-0.7], finished=[None], cached_tokens=[0],
                       top_logprobs=alternatives, prompt_logprobs=[prompt])  # fmt: skip
    ((_, first),) = frontend.on_scheduler_msg(batch).replies
    assert first.prompt_token_ids == [10, 11, 12] and first.prompt_text == tokenizer.decode([10, 11, 12])
    assert first.prompt_logprobs == [None, -3.0, -4.0]
    assert first.prompt_top_logprobs == [None, *(TopLogprobs(token_ids=t.token_ids, logprobs=t.logprobs)
                                                 for t in top)]  # fmt: skip
    assert first.top_logprobs == [TopLogprobs(token_ids=[13, 14], logprobs=[-0.7, -0.9])]
    (last,) = _run(frontend, req.rid, [15], FinishReason.LENGTH)
    assert last.prompt_token_ids is None, "the prompt is echoed once per stream"
    assert last.top_logprobs == [TopLogprobs(token_ids=[], logprobs=[])]


def test_prompt_only_request_finishes_with_its_prompt(frontend: Frontend) -> None:
    req = _submit(
        frontend, prompt=None, input_ids=[10, 11], echo=True, logprobs=True, sampling={"max_new_tokens": 0}
    )
    prompt = PromptLogprobs(rid=req.rid, logprobs=[-1.5], top=[])
    batch = TokenBatch(rids=[req.rid], token_ids=[-1], logprobs=[0.0], finished=[FinishReason.LENGTH],
                       cached_tokens=[0], prompt_logprobs=[prompt])  # fmt: skip
    ((_, reply),) = frontend.on_scheduler_msg(batch).replies
    assert (reply.finish_reason, reply.token_ids, reply.prompt_logprobs) == (
        FinishReason.LENGTH,
        [],
        [None, -1.5],
    )
    assert reply.prompt_top_logprobs is None and _usage(reply).completion_tokens == 0
