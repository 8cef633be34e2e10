"""response_format, regex and ebnf -> the request's Grammar, and their rejections naming the field,
without an engine."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from protocol.grammar import Grammar
from tokenizer_proc.http.convert import chat_request, completion_requests, rejection_error
from tokenizer_proc.http.errors import ApiError
from tokenizer_proc.http.schemas import ChatCompletionRequest, CompletionRequest, decode_body
from tokenizer_proc.validation import RequestRejected

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _chat(**fields: object) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return decode_body(msgspec.json.encode(body), ChatCompletionRequest)


def _chat_grammar(**fields: object) -> Grammar | None:
    return chat_request(_chat(**fields), "r").sampling.grammar


@pytest.mark.parametrize(
    ("fields", "grammar"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, Grammar(kind="json_object")),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
            Grammar(kind="json_schema", spec=json.dumps(SCHEMA), strict=False),
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            Grammar(kind="json_schema", spec=json.dumps(SCHEMA), strict=True),
        ),
        ({"regex": "[a-z]+"}, Grammar(kind="regex", spec="[a-z]+")),
        ({"ebnf": 'root ::= "a"'}, Grammar(kind="ebnf", spec='root ::= "a"')),
    ],
)
def test_chat_constraints_become_the_request_s_grammar(
    fields: dict[str, Any], grammar: Grammar | None
) -> None:
    assert _chat_grammar(**fields) == grammar


def test_completions_take_regex_and_ebnf() -> None:
    body = decode_body(msgspec.json.encode({"prompt": "hi", "regex": "x+"}), CompletionRequest)
    (req,) = completion_requests(body, "r")
    assert req.sampling.grammar == Grammar(kind="regex", spec="x+")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": "no"}}}, "response_format"),
        ({"response_format": {"type": "json_object", "schema": {}}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
    ],
)
def test_malformed_or_double_constraints_are_a_400_naming_the_field(
    fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(ApiError) as info:
        chat_request(_chat(**fields), "r")
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize("field", ["response_format", "regex", "ebnf"])
def test_a_grammar_that_does_not_compile_names_its_field(field: str) -> None:
    exc = RequestRejected("sampling.grammar", "cannot be compiled: bad")
    error = rejection_error(exc, chat=True, max_param="max_tokens", grammar_param=field)
    assert error.param == field and error.message == f"{field} cannot be compiled: bad"
