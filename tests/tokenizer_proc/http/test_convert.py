"""OpenAI bodies -> GenerateRequest, and engine rejections -> OpenAI errors, without an engine."""

from __future__ import annotations

import msgspec
import pytest

from protocol.messages import GenerateRequest
from tokenizer_proc.http.convert import chat_request, completion_requests, rejection_error
from tokenizer_proc.http.errors import ApiError, engine_error
from tokenizer_proc.http.schemas import ChatCompletionRequest, CompletionRequest, decode_body
from tokenizer_proc.intake import SHUTTING_DOWN
from tokenizer_proc.validation import RequestRejected


def _completion(**fields: object) -> CompletionRequest:
    return decode_body(msgspec.json.encode({"prompt": "hi", **fields}), CompletionRequest)


def completion_request(body: CompletionRequest, rid: str) -> GenerateRequest:
    (req,) = completion_requests(body, rid)
    return req


def _chat(**fields: object) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return decode_body(msgspec.json.encode(body), ChatCompletionRequest)


def test_completion_defaults_and_prompt_forms() -> None:
    req = completion_request(_completion(), "cmpl-1")
    assert (req.prompt, req.input_ids, req.sampling.max_new_tokens, req.logprobs) == ("hi", None, 16, False)
    assert completion_request(_completion(prompt=[5, 6]), "r").input_ids == [5, 6]
    assert completion_request(_completion(prompt=[[5, 6]]), "r").input_ids == [5, 6]
    assert completion_request(_completion(prompt=["one"]), "r").prompt == "one"
    req = completion_request(_completion(stop="END", logprobs=0, top_k=3, seed=9), "r")
    assert (req.sampling.stop, req.logprobs, req.sampling.top_k, req.sampling.seed) == (["END"], True, 3, 9)
    req = completion_request(_completion(logprobs=20, echo=True, max_tokens=0), "r")
    assert (req.logprobs, req.top_logprobs, req.echo, req.sampling.max_new_tokens) == (True, 20, True, 0)


def test_a_batch_of_prompts_is_one_request_per_prompt() -> None:
    texts = completion_requests(_completion(prompt=["a", "b", "c"], logprobs=2), "cmpl-x")
    assert [(r.rid, r.prompt, r.input_ids, r.top_logprobs) for r in texts] == [
        ("cmpl-x-0", "a", None, 2), ("cmpl-x-1", "b", None, 2), ("cmpl-x-2", "c", None, 2)
    ]  # fmt: skip
    ids = completion_requests(_completion(prompt=[[5, 6], [7], [8, 9, 10]], echo=True, max_tokens=1), "r")
    assert [r.input_ids for r in ids] == [[5, 6], [7], [8, 9, 10]] and all(r.echo for r in ids)


def test_chat_top_logprobs() -> None:
    req = chat_request(_chat(logprobs=True, top_logprobs=20), "r")
    assert (req.logprobs, req.top_logprobs) == (True, 20)


def test_chat_takes_max_completion_tokens_first_and_text_parts() -> None:
    req = chat_request(_chat(max_tokens=5, max_completion_tokens=7), "r")
    assert req.sampling.max_new_tokens == 7
    parts = [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    req = chat_request(_chat(messages=parts), "r")
    assert req.messages is not None and (req.messages[0].role, req.messages[0].content) == ("system", "ab")


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"),
     ({"best_of": 2, "n": 3}, "best_of"), ({"best_of": 3, "n": 2, "stream": True}, "best_of"),
     ({"logit_bias": {"five": 1.0}}, "logit_bias"),
     ({"stream_options": {"include_usage": True}}, "stream_options"), ({"prompt": [1, "a"]}, "prompt"),
     ({"prompt": ["a", [1]]}, "prompt"), ({"prompt": []}, "prompt"), ({"max_tokens": 0}, "max_tokens")],
)  # fmt: skip
def test_unsupported_completion_fields_name_the_parameter(fields: dict[str, object], param: str) -> None:
    with pytest.raises(ApiError) as exc:
        completion_request(_completion(**fields), "r")
    assert (exc.value.status, exc.value.param) == (400, param)


@pytest.mark.parametrize(
    "fields",
    [{"top_logprobs": 21, "logprobs": True}, {"top_logprobs": -1, "logprobs": True}, {"top_logprobs": 2}],
)
def test_bad_chat_top_logprobs_name_the_parameter(fields: dict[str, object]) -> None:
    with pytest.raises(ApiError) as exc:
        chat_request(_chat(**fields), "r")
    assert (exc.value.status, exc.value.param) == (400, "top_logprobs")


def test_echo_is_not_a_chat_field() -> None:
    with pytest.raises(ApiError) as exc:
        _chat(echo=True)
    assert (exc.value.status, exc.value.param) == (400, "echo")


def test_decode_errors_name_the_field() -> None:
    with pytest.raises(ApiError) as exc:
        decode_body(b'{"messages": [{"role": "user", "content": "x", "nme": "a"}]}', ChatCompletionRequest)
    assert exc.value.param == "messages[0].nme"
    with pytest.raises(ApiError) as exc:
        decode_body(b'{"prompt": "x", "max_tokens": 1.5}', CompletionRequest)
    assert exc.value.param == "max_tokens"


def test_rejections_are_spelt_the_openai_way() -> None:
    max_new = RequestRejected("sampling.max_new_tokens", "must be >= 1, got 0")
    err = rejection_error(max_new, chat=True, max_param="max_completion_tokens")
    assert (err.status, err.param, err.message) == (
        400,
        "max_completion_tokens",
        "max_completion_tokens must be >= 1, got 0",
    )
    assert rejection_error(RequestRejected("prompt", "is long", "context_length_exceeded"), chat=True,
                           max_param="max_tokens").param == "messages"  # fmt: skip
    top = rejection_error(
        RequestRejected("top_logprobs", "must be in [0, 20]"), chat=False, max_param="max_tokens"
    )
    assert top.param == "logprobs", "the legacy API calls it logprobs"
    draining = rejection_error(
        RequestRejected(None, "bye", SHUTTING_DOWN), chat=False, max_param="max_tokens"
    )
    assert draining.status == 503
    assert engine_error("forward pass failed: boom").status == 500
    assert engine_error("prompt (9 tokens) + max_new_tokens (5) exceeds the context length 10").status == 400


def test_penalties_reach_the_engine_request_with_token_id_keys() -> None:
    fields = dict(presence_penalty=0.5, frequency_penalty=-1.0, logit_bias={"7": 3.0, "12": -100})
    req = completion_request(_completion(**fields, repetition_penalty=1.2, min_tokens=4, max_tokens=9), "r")
    s = req.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_tokens) == (
        0.5,
        -1.0,
        1.2,
        4,
    )
    assert s.logit_bias == {7: 3.0, 12: -100.0}
    chat = chat_request(_chat(**fields), "r").sampling
    assert (chat.presence_penalty, chat.logit_bias, chat.repetition_penalty) == (
        0.5,
        {7: 3.0, 12: -100.0},
        1.0,
    )


def test_penalty_rejections_keep_openai_names() -> None:
    for field in ("presence_penalty", "logit_bias", "min_tokens", "repetition_penalty"):
        error = rejection_error(
            RequestRejected(f"sampling.{field}", "is bad"), chat=False, max_param="max_tokens"
        )
        assert (error.status, error.param) == (400, field)


def test_chat_tools_and_tool_history_map_to_the_engine_request() -> None:
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    messages = [
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]  # fmt: skip
    req = chat_request(
        _chat(messages=messages, tools=[tool], chat_template_kwargs={"enable_thinking": False}), "r"
    )
    assert req.tools is not None and req.tools[0].function.name == "add" and req.tool_choice == "auto"
    assert req.chat_template_kwargs == {"enable_thinking": False}
    assert req.messages is not None
    assistant, result = req.messages[1:]
    assert assistant.content is None and assistant.tool_calls is not None
    assert assistant.tool_calls[0].function.name == "add"
    assert (result.role, result.tool_call_id, result.content) == ("tool", "call_1", "3")
    named = {"type": "function", "function": {"name": "add"}}
    assert (
        chat_request(_chat(messages=messages[:1], tools=[tool], tool_choice=named), "r").tool_choice != "auto"
    )


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "add"}}])
def test_tool_choice_without_tools_is_refused(choice: object) -> None:
    with pytest.raises(ApiError) as caught:
        chat_request(_chat(messages=[{"role": "user", "content": "hi"}], tool_choice=choice), "r")
    assert caught.value.param == "tool_choice"


@pytest.mark.parametrize("role", ["user", "system", "developer", "tool", "assistant"])
def test_null_content_is_refused_but_on_an_assistant_turn_with_tool_calls(role: str) -> None:
    message = {"role": role, "content": None, "tool_call_id": "call_1"} if role == "tool" else {"role": role}
    with pytest.raises(ApiError) as caught:
        chat_request(_chat(messages=[{"role": "user", "content": "hi"}, message]), "r")
    assert (caught.value.status, caught.value.param) == (400, "messages[1].content")
