"""Penalties, logit_bias and min_tokens sent by the official ``openai`` package to a real engine
(HTTP) give what the ZMQ client's ``generate`` gives with the same options."""

from __future__ import annotations

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from client import Client, EngineError
from tests.tokenizer_proc.http.server import HttpEngine

PROMPT = "The capital of France is"
CHAT_TEXT = "Name three rivers."
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": CHAT_TEXT}]
FORCED = 1000  # a token logit_bias pushes to the top


def test_presence_frequency_and_repetition_penalties(oai: openai.OpenAI, api: HttpEngine) -> None:
    out = oai.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, presence_penalty=2.0,
        frequency_penalty=0.5, extra_body={"ignore_eos": True, "repetition_penalty": 1.5},
    )  # fmt: skip
    with Client(api.engine.endpoint, timeout_s=60) as c:
        plain = c.generate(PROMPT, max_new_tokens=16, temperature=0, ignore_eos=True)
        ref = c.generate(
            PROMPT, max_new_tokens=16, temperature=0, ignore_eos=True, presence_penalty=2.0,
            frequency_penalty=0.5, repetition_penalty=1.5,
        )  # fmt: skip
    assert out.choices[0].text == ref.text and out.usage is not None and out.usage.completion_tokens == 16
    assert len(set(ref.token_ids)) == 16, "a presence penalty of 2 never repeats a token on this model"
    assert ref.token_ids != plain.token_ids


def test_logit_bias_forces_a_token_in_chat(oai: openai.OpenAI, api: HttpEngine) -> None:
    chat = oai.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=5, temperature=0, logit_bias={str(FORCED): 100}
    )
    with Client(api.engine.endpoint, timeout_s=60) as c:
        messages = [{"role": "user", "content": CHAT_TEXT}]
        ref = c.generate(messages=messages, max_new_tokens=5, temperature=0, logit_bias={FORCED: 100})
    assert ref.token_ids == [FORCED] * 5
    assert chat.choices[0].message.content == ref.text


def test_min_tokens_holds_back_a_stop_token(oai: openai.OpenAI, api: HttpEngine) -> None:
    """The forced token is also a stop token: without min_tokens it ends the request at once."""
    body = {"ignore_eos": True, "stop_token_ids": [FORCED]}
    base = dict(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, logit_bias={str(FORCED): 100})
    at_once = oai.completions.create(extra_body=body, **base)  # type: ignore[call-overload]
    held = oai.completions.create(extra_body={**body, "min_tokens": 3}, **base)  # type: ignore[call-overload]
    assert at_once.usage.completion_tokens == 1 and at_once.choices[0].finish_reason == "stop"
    assert held.usage.completion_tokens == 4 and held.choices[0].finish_reason == "stop"
    with Client(api.engine.endpoint, timeout_s=60) as c:
        ref = c.generate(
            PROMPT, max_new_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[FORCED],
            logit_bias={FORCED: 100}, min_tokens=3,
        )  # fmt: skip
    assert FORCED not in ref.token_ids[:3] and ref.token_ids[3] == FORCED and len(ref.token_ids) == 4


def test_zmq_client_gets_an_error_naming_the_field_and_the_engine_serves_on(api: HttpEngine) -> None:
    with Client(api.engine.endpoint, timeout_s=60) as c:
        with pytest.raises(EngineError, match=r"sampling\.logit_bias .*outside the vocabulary"):
            c.generate(PROMPT, max_new_tokens=2, logit_bias={10**6: 1.0})
        with pytest.raises(EngineError, match=r"sampling\.presence_penalty must be in \[-2, 2\]"):
            c.generate(PROMPT, max_new_tokens=2, presence_penalty=2.5)
        with pytest.raises(EngineError, match=r"sampling\.min_tokens"):
            c.generate(PROMPT, max_new_tokens=2, min_tokens=5)
        assert len(c.generate(PROMPT, max_new_tokens=2, ignore_eos=True).token_ids) == 2
