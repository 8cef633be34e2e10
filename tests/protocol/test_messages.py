"""Round trips of every channel and rejection of garbage frames."""

from __future__ import annotations

import msgspec
import pytest

from protocol import (
    AbortRequest,
    ChatMessage,
    ClientReply,
    ClientRequest,
    EngineStats,
    FinishReason,
    FinishReq,
    ForwardBatch,
    ForwardResult,
    FromWorker,
    GenerateOutput,
    GenerateRequest,
    Ready,
    RequestError,
    SamplingParams,
    TokenBatch,
    TokenizedRequest,
    ToLauncher,
    ToScheduler,
    ToTokenizer,
    ToWorker,
    Usage,
    WorkerReady,
    WorkerSampling,
)
from protocol.logprobs import PromptLogprobs, TopLogprobs, TopTokens
from protocol.transport import Codec

SAMPLER = WorkerSampling(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=123)

CASES = [
    (
        ClientRequest,
        GenerateRequest(rid="a", prompt="héllo 🌍", sampling=SamplingParams(stop=["\n"]), stream=True),
    ),
    (ClientRequest, GenerateRequest(rid="b", messages=[ChatMessage(role="user", content="hi")])),
    (ClientRequest, GenerateRequest(rid="c", input_ids=[1, 2, 3], logprobs=True)),
    (ClientRequest, GenerateRequest(rid="d", input_ids=[1, 2], logprobs=True, top_logprobs=20, echo=True)),
    (ClientRequest, AbortRequest(rid="a")),
    (
        ClientReply,
        GenerateOutput(
            rid="e",
            token_ids=[5],
            logprobs=[-0.25],
            top_logprobs=[TopLogprobs(token_ids=[5, 6], logprobs=[-0.25, -2.0])],
            prompt_token_ids=[1, 2],
            prompt_text="hi",
            prompt_logprobs=[None, -3.5],
            prompt_top_logprobs=[None, TopLogprobs(token_ids=[2, 9], logprobs=[-3.5, -4.0])],
        ),
    ),
    (
        ClientReply,
        GenerateOutput(
            rid="a",
            text="x",
            token_ids=[5],
            finish_reason=FinishReason.LENGTH,
            usage=Usage(prompt_tokens=3, completion_tokens=1),
        ),
    ),
    (
        ToScheduler,
        TokenizedRequest(rid=7, input_ids=[1, 2], max_new_tokens=4, stop_token_ids=[2], sampler=SAMPLER),
    ),
    (ToScheduler, FinishReq(rid=7, reason=FinishReason.STOP)),
    (
        ToTokenizer,
        TokenBatch(
            rids=[1, 2],
            token_ids=[9, -1],
            logprobs=[-0.5, 0.0],
            finished=[None, FinishReason.ABORT],
            cached_tokens=[0, 0],
        ),
    ),
    (
        ToTokenizer,
        TokenBatch(
            rids=[4],
            token_ids=[-1],
            logprobs=[0.0],
            finished=[FinishReason.LENGTH],
            cached_tokens=[0],
            top_logprobs=[TopTokens([], [])],
            prompt_logprobs=[PromptLogprobs(rid=4, logprobs=[-1.0, -2.0], top=[TopTokens([3], [-0.5])] * 2)],
        ),
    ),
    (ToTokenizer, RequestError(rid=3, message="too long")),
    (ToTokenizer, EngineStats(num_running=2, num_waiting=1, num_pages=64, free_pages=40, evictable_pages=8)),
    (
        ToWorker,
        ForwardBatch(
            step=1,
            req_pool_idx=[0, 1],
            prefix_lens=[0, 5],
            extend_lens=[3, 1],
            input_ids=[4, 5, 6, 7],
            page_starts=[0, 1],
            page_counts=[1, 0],
            pages=[12],
            sample=[True, True],
            sampler=[SAMPLER, None],
            prompt_logprob_lens=[2, 0],
            prompt_logprob_targets=[5, 6],
        ),
    ),
    (FromWorker, ForwardResult(step=1, token_ids=[3, 4], logprobs=[-1.0, -2.0], forward_s=0.01)),
    (
        FromWorker,
        ForwardResult(
            step=2,
            token_ids=[3],
            logprobs=[-1.0],
            forward_s=0.01,
            top_logprobs=[TopTokens([3], [-1.0])],
            prompt_logprobs=[-0.5, -0.7],
            prompt_top_logprobs=[TopTokens([8], [-0.1])] * 2,
        ),
    ),  # fmt: skip
    (ToLauncher, Ready(proc="tokenizer", pid=10)),
    (
        ToLauncher,
        WorkerReady(pid=11, num_pages=64, page_size=16, context_len=2048, device="cpu", dtype="float32"),
    ),
]


@pytest.mark.parametrize(("channel", "msg"), CASES, ids=lambda x: type(x).__name__)
def test_round_trip(channel: object, msg: msgspec.Struct) -> None:
    codec: Codec[object] = Codec(channel)
    assert codec.decode(codec.encode(msg)) == msg


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xff\xfe garbage",
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode({"type": "nope", "rid": "a"}),
        msgspec.msgpack.encode({"type": "generate", "rid": "a", "prompt": "x", "temprature": 0.5}),
        msgspec.msgpack.encode({"type": "generate", "rid": 5, "prompt": "x"}),
    ],
)
def test_client_channel_rejects_garbage(frame: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        Codec(ClientRequest).decode(frame)


def test_internal_channel_rejects_another_channels_message() -> None:
    codec: Codec[ToWorker] = Codec(ToWorker)
    frame = codec.encode(FinishReq(rid=1, reason=FinishReason.ABORT))
    with pytest.raises(msgspec.ValidationError):
        codec.decode(frame)


def test_protocol_imports_nothing_of_ours() -> None:
    import ast
    import pathlib

    ours = {"tokenizer_proc", "scheduler_proc", "gpu_worker", "client", "launcher"}
    for path in pathlib.Path(__file__).resolve().parents[2].joinpath("protocol").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom | ast.Import):
                names = (
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                )
                assert not {n.split(".")[0] for n in names} & ours, f"{path.name} imports {names}"
