"""Chat-completions fields beyond sampling: OpenAI's legacy ``functions`` / ``function_call``
mapped to tools, ``reasoning_effort`` as a template variable, and the fields with no effect here,
accepted at the values rivulet can honour and echoed as OpenAI's reply echoes them.

Legacy functions are the old form of one tool call a turn: ``functions`` are tools,
``function_call`` ("none", "auto" or ``{"name": ...}``) the tool_choice, calls after the first
are dropped (parallel_tool_calls false), and the reply says ``message.function_call`` and
finish_reason ``function_call`` (completion_bodies.py). A history's ``function_call`` and
``function`` messages become a tool call and its result.
"""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.chat import NamedFunction, NamedToolChoice, Tool, ToolCall, ToolChoice
from tokenizer_proc.http.errors import bad_param
from tokenizer_proc.http.schemas import ChatCompletionRequest, ChatMessageIn

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# OpenAI's tiers and verbosities, all accepted: one tier serves every request here (the reply says
# "default", the tier that served it), and no template reads a verbosity.
SERVICE_TIERS = (None, "auto", "default", "flex", "scale", "priority")
VERBOSITIES = (None, "low", "medium", "high")


def check_accepted_fields(body: ChatCompletionRequest) -> None:
    """A 400 naming a field set to what rivulet cannot do (audio out) or OpenAI does not name."""
    refused: list[tuple[str, bool, str]] = [
        ("service_tier", body.service_tier not in SERVICE_TIERS, f"must be one of {list(SERVICE_TIERS[1:])}"),
        ("verbosity", body.verbosity not in VERBOSITIES, f"must be one of {list(VERBOSITIES[1:])}"),
        ("modalities", any(m != "text" for m in body.modalities or []), 'only "text" output is supported'),
        ("reasoning_effort", body.reasoning_effort not in (None, *REASONING_EFFORTS),
         f"reasoning_effort must be one of {list(REASONING_EFFORTS)}"),
        ("function_call", body.function_call is not None and not body.functions,
         "function_call needs functions"),
        ("functions", bool(body.functions) and body.tools is not None, "give tools or functions, not both"),
    ]  # fmt: skip
    for param, asked, message in refused:
        if asked:
            raise bad_param(param, message)


def effort_kwargs(effort: str | None) -> dict[str, Any]:
    """A reasoning effort as template variables: ``reasoning_effort`` (vLLM's spelling); "none"
    also sets ``enable_thinking`` false (Qwen3's switch). A template reading neither answers as
    it would without them."""
    if effort is None:
        return {}
    kwargs: dict[str, Any] = {"reasoning_effort": effort}
    if effort == "none":
        kwargs["enable_thinking"] = False
    return kwargs


def template_kwargs(body: ChatCompletionRequest) -> dict[str, Any] | None:
    """``chat_template_kwargs`` over ``reasoning_effort``'s variables (the explicit ones win)."""
    kwargs = {**effort_kwargs(body.reasoning_effort), **(body.chat_template_kwargs or {})}
    return kwargs if kwargs or body.chat_template_kwargs is not None else None


def tools_of(body: ChatCompletionRequest) -> tuple[list[Tool] | None, ToolChoice | None, bool]:
    """The request's tools, its tool_choice (None: OpenAI's default) and whether at most one call
    may be made, from ``tools`` or from the legacy ``functions``."""
    if not body.functions:
        return body.tools, body.tool_choice, body.parallel_tool_calls is False
    tools = [Tool(function=f) for f in body.functions]
    choice = body.function_call
    if isinstance(choice, NamedFunction):
        return tools, NamedToolChoice(function=choice), True
    return tools, choice, True


def legacy_history(messages: list[ChatMessageIn]) -> list[ChatMessageIn]:
    """The history with legacy calls as tool calls: an assistant's ``function_call`` gets the id
    ``call_<its index>``, and a ``function`` message answers the last such call."""
    out: list[ChatMessageIn] = []
    last_id: str | None = None
    for i, m in enumerate(messages):
        if m.function_call is not None:
            last_id = f"call_{i}"
            call = ToolCall(id=last_id, function=m.function_call)
            m = msgspec.structs.replace(m, function_call=None, tool_calls=[*(m.tool_calls or []), call])
        elif m.role == "function":
            if last_id is None:
                raise bad_param(f"messages[{i}]", "a function message must follow a function_call")
            m = msgspec.structs.replace(m, role="tool", tool_call_id=last_id)
        out.append(m)
    return out


def reply_echo(body: ChatCompletionRequest) -> dict[str, Any]:
    """The request's fields a chat completion object repeats."""
    echo: dict[str, Any] = {"service_tier": "default"}
    if body.metadata is not None:
        echo["metadata"] = body.metadata
    return echo


def legacy_call(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call (whole or a streamed piece) as the legacy ``function_call``: name and arguments."""
    function = call["function"]
    return {k: function[k] for k in ("name", "arguments") if k in function}
