"""The body of ``POST /v1/responses`` (OpenAI's Responses API) as msgspec structs.

Unknown fields are a 400, as on the other endpoints. ``input`` items, ``tools`` and ``tool_choice``
stay plain JSON here and are read one by one in responses_input.py, so a rejection names the item
(``input[2].type``); fields rivulet does not implement are accepted only at their neutral values
(``unsupported_fields`` lists the others, each a 400 naming the field).
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import msgspec

from tokenizer_proc.http.chat_fields import REASONING_EFFORTS, SERVICE_TIERS, VERBOSITIES
from tokenizer_proc.http.errors import bad_param
from tokenizer_proc.http.schemas import Body, Int64, invalid_field

T = TypeVar("T")

LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the one ``include`` value served


class TextFormat(Body):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (name, schema, strict)."""

    type: str
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(Body):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(Body):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None  # OpenAI's deprecated spelling of ``summary``


class ResponsesStreamOptions(Body):
    include_obfuscation: bool | None = None


class ResponsesRequest(Body):
    """``POST /v1/responses``."""

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None  # None: OpenAI's default, true
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    include: list[str] | None = None
    top_logprobs: Int64 | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # a routing hint at OpenAI; rivulet's cache finds prefixes itself
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None  # auto: responses_api.py drops old items
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None  # echoed; the cache is in memory
    # Accepted only absent or at their neutral value (unsupported_fields):
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Int64 | None = None


def unsupported_fields(body: ResponsesRequest) -> None:
    """A 400 naming the first field set to something rivulet does not do."""
    refused: list[tuple[str, bool, str]] = [
        ("background", bool(body.background), "background mode is not supported"),
        ("conversation", body.conversation is not None, "not supported; use previous_response_id"),
        ("prompt", body.prompt is not None, "stored prompt templates are not supported"),
        ("max_tool_calls", body.max_tool_calls is not None, "max_tool_calls is not supported"),
        ("service_tier", body.service_tier not in SERVICE_TIERS, f"must be one of {list(SERVICE_TIERS[1:])}"),
        ("stream_options", body.stream_options is not None and not body.stream, "needs stream=true"),
        ("stream_options.include_obfuscation", _obfuscation(body), "stream obfuscation is not supported"),
        ("text.verbosity", body.text is not None and body.text.verbosity not in VERBOSITIES,
         f"must be one of {list(VERBOSITIES[1:])}"),
    ]  # fmt: skip
    for param, asked, message in refused:
        if asked:
            raise bad_param(param, message)
    for i, name in enumerate(body.include or []):
        if name != LOGPROBS_INCLUDE:
            raise bad_param(f"include[{i}]", f"only {LOGPROBS_INCLUDE!r} can be included, got {name!r}")
    reasoning = body.reasoning or ReasoningConfig()
    if reasoning.effort is not None and reasoning.effort not in REASONING_EFFORTS:
        raise bad_param(
            "reasoning.effort", f"must be one of {list(REASONING_EFFORTS)}, got {reasoning.effort!r}"
        )
    if reasoning.summary is not None or reasoning.generate_summary is not None:
        raise bad_param("reasoning.summary", "reasoning summaries are not supported (reasoning text is)")


def _obfuscation(body: ResponsesRequest) -> bool:
    return body.stream_options is not None and bool(body.stream_options.include_obfuscation)


# The input items read from ``input`` (responses_input.py): unknown fields are a 400 here too.


class MessageItem(Body):
    """A message: ``content`` a string or parts (``input_text``, an assistant's ``output_text``)."""

    role: str
    content: str | list[dict[str, Any]]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None


class ReasoningItem(Body):
    """A reasoning item sent back in the history: its text goes with the assistant turn after it,
    shown to harmony models only (as chat's ``reasoning_content``; other templates drop past
    thinking)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class AllowedToolsIn(Body):
    """``tool_choice`` ``{"type": "allowed_tools", "mode": ..., "tools": [...]}``; the tools are
    read one by one (responses_input.py)."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]


class FunctionToolIn(Body):
    """A function tool, Responses-style (flat: no ``function`` wrapper)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


def convert_item(value: Any, kind: type[T], param: str) -> T:
    """``value`` as a ``kind``, or a 400 naming the field under ``param``."""
    try:
        return msgspec.convert(value, type=kind)
    except msgspec.ValidationError as exc:
        raise bad_param(
            invalid_field(exc, param) or param, f"invalid {param}: {exc}", "invalid_type"
        ) from None
