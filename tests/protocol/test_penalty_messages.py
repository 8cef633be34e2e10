"""The penalty fields on the wire: client requests, the worker's sampler and prefix_ids."""

from __future__ import annotations

import msgspec
import pytest

from client.common import make_request
from protocol.messages import ClientRequest, ForwardBatch, GenerateRequest, SamplingParams, ToWorker
from protocol.sampling import WorkerPenalties, WorkerSampling
from protocol.transport import Codec


def test_client_penalties_round_trip_with_int_token_ids() -> None:
    sampling = SamplingParams(
        presence_penalty=0.5,
        frequency_penalty=-1.0,
        repetition_penalty=1.2,
        logit_bias={7: 3.0},
        min_tokens=2,
    )
    req = GenerateRequest(rid="a", prompt="x", sampling=sampling)
    codec: Codec[ClientRequest] = Codec(ClientRequest)
    assert codec.decode(codec.encode(req)) == req


def test_generate_options_carry_the_penalties() -> None:
    req = make_request("x", False, {"presence_penalty": 1.0, "logit_bias": {5: -2.0}, "min_tokens": 3})
    assert (req.sampling.presence_penalty, req.sampling.logit_bias, req.sampling.min_tokens) == (
        1.0,
        {5: -2.0},
        3,
    )


def test_a_misspelt_penalty_is_an_error() -> None:
    frame = msgspec.msgpack.encode(
        {"type": "generate", "rid": "a", "prompt": "x", "sampling": {"presense_penalty": 1}}
    )
    with pytest.raises(msgspec.ValidationError, match="presense_penalty"):
        Codec(ClientRequest).decode(frame)


def test_forward_batch_with_penalties_and_prefix_ids_round_trips() -> None:
    penalties = WorkerPenalties(
        prompt_len=3, presence=0.5, bias_ids=[4], bias_values=[1.5], min_tokens=1, min_tokens_ids=[2]
    )
    sampler = WorkerSampling(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=1, penalties=penalties)
    batch = ForwardBatch(
        step=1, req_pool_idx=[0, 1], prefix_lens=[2, 0], extend_lens=[1, 1], input_ids=[5, 6],
        page_starts=[0, 0], page_counts=[1, 1], pages=[0, 1], sample=[True, True],
        sampler=[sampler, None], prefix_ids=[[8, 9], []],
    )  # fmt: skip
    codec: Codec[ToWorker] = Codec(ToWorker)
    assert codec.decode(codec.encode(batch)) == batch
    plain = msgspec.structs.replace(batch, sampler=[None, None], prefix_ids=[])
    assert codec.decode(codec.encode(plain)).prefix_ids == []
