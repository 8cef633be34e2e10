"""Checks of a chat request's tools, tool_choice, tool messages and template variables, and the
grammar that forces a call (``tool_choice`` "required" or a named function).

Every rejection names the field as OpenAI spells it (``tools[1].function.name``, ``tool_choice``,
``messages[3].tool_call_id``), so the HTTP layer passes it through unchanged.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from protocol.chat import AllowedToolsChoice, ChatMessage, NamedToolChoice, Tool, ToolChoice
from protocol.grammar import Grammar
from protocol.messages import GenerateRequest
from tokenizer_proc.chat.harmony_prompt import harmony_call_grammar, harmony_call_or_format
from tokenizer_proc.chat.tool_parsers import ToolFormat
from tokenizer_proc.grammar import CallRejected, FormatRejected, call_or_format_grammar
from tokenizer_proc.validation_error import RequestRejected

_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule, plus '.' (some tool names have it)
# Arguments apply_chat_template takes itself: a client must not set them through the template variables.
_RESERVED_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "add_generation_prompt",
                              "continue_final_message", "tokenize", "return_dict", "chat_template",
                              "padding", "truncation", "max_length", "return_tensors", "tokenizer_kwargs",
                              "return_assistant_tokens_mask"})  # fmt: skip
MAX_TOOLS = 128


def offered_tools(tools: list[Tool] | None, choice: ToolChoice) -> tuple[list[Tool], bool]:
    """The tools the model is offered (none for tool_choice "none"), and whether a call is forced."""
    tools = tools or []
    if len(tools) > MAX_TOOLS:
        raise RequestRejected("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if not _FUNCTION_NAME.match(name):
            raise RequestRejected(
                f"tools[{i}].function.name", f"must match {_FUNCTION_NAME.pattern}, got {name!r}"
            )
        if name in names:
            raise RequestRejected(f"tools[{i}].function.name", f"{name!r} is given twice")
        names.add(name)
        params = tool.function.parameters
        if params is not None and params.get("type", "object") != "object":
            raise RequestRejected(f"tools[{i}].function.parameters", "must be a JSON schema of type object")
        parameters_json(i, tool)
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise RequestRejected("tool_choice", f"names {choice.function.name!r}, which is not among tools")
        return [t for t in tools if t.function.name == choice.function.name], True
    if isinstance(choice, AllowedToolsChoice):
        return _allowed_tools(tools, choice), choice.allowed_tools.mode == "required"
    if choice == "required" and not tools:
        raise RequestRejected("tool_choice", '"required" needs tools')
    return ([] if choice == "none" else tools), choice == "required"


def _allowed_tools(tools: list[Tool], choice: AllowedToolsChoice) -> list[Tool]:
    """The tools ``allowed_tools`` lists, each of which must be among ``tools``."""
    names = {t.function.name for t in tools}
    listed = choice.allowed_tools.tools
    for j, allowed in enumerate(listed):
        if allowed.function.name not in names:
            raise RequestRejected(
                f"tool_choice.allowed_tools.tools[{j}]",
                f"names {allowed.function.name!r}, which is not among tools",
            )
    if not listed and choice.allowed_tools.mode == "required":
        raise RequestRejected("tool_choice.allowed_tools.tools", 'must list a tool with mode "required"')
    allowed_names = {allowed.function.name for allowed in listed}
    return [t for t in tools if t.function.name in allowed_names]


def parameters_json(i: int, tool: Tool) -> str | None:
    """Tool ``i``'s parameters schema as JSON text (None when it has none); refused, naming them,
    when they are not JSON (a ZMQ client's msgpack may carry bytes, extension types, NaN)."""
    params = tool.function.parameters
    if params is None:
        return None
    try:
        return json.dumps(params, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise RequestRejected(f"tools[{i}].function.parameters", f"is not JSON: {exc}") from None


def forced_call_grammar(
    tools: list[Tool], choice: ToolChoice, tool_format: ToolFormat = "hermes"
) -> Grammar | None:
    """The JSON schema of one call object ``{"name": ..., "arguments": {...}}`` of the offered tools,
    for a forced choice (the model then writes the bare object, which the ``json`` parser reads);
    a harmony model's call message instead (chat/harmony_prompt.py); None when the model may
    answer freely."""
    offered, forced = offered_tools(tools, choice)
    if not forced:
        return None
    if tool_format == "harmony":
        try:
            return harmony_call_grammar(offered)
        except Exception as exc:  # xgrammar raises RuntimeError (and its own types) on bad input
            raise RequestRejected("tools", f"a tool's parameters cannot be compiled: {exc}") from None
    calls = [call_schema(t) for t in offered]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return Grammar(kind="json_schema", spec=json.dumps(schema))


def with_tool_grammar(req: GenerateRequest, tool_format: ToolFormat = "hermes") -> GenerateRequest:
    """``req`` with the grammar its tools set in ``sampling.grammar`` (unchanged when they set
    none). Applied once, as a request begins its admission (tokenizer_proc/intake.py), before
    anything looks at its grammar; ``tool_format``: how the model writes calls (its template's).

    A forced call replaces the client's own grammar (``response_format``, ``text.format``): as at
    OpenAI, the format is for text and a forced call writes none. Tools offered freely beside the
    client's grammar make one grammar of both: calls in ``tool_format``, or text in the format."""
    grammar = tool_grammar(req, tool_format)
    if grammar is None and req.messages is not None and req.sampling.grammar is not None:
        grammar = _call_or_format(req, tool_format)
    if grammar is None or req.sampling.grammar == grammar:
        return req
    return msgspec.structs.replace(req, sampling=msgspec.structs.replace(req.sampling, grammar=grammar))


def _call_or_format(req: GenerateRequest, tool_format: ToolFormat) -> Grammar | None:
    """The call-or-format grammar of a chat request that offers tools freely beside its grammar;
    None when it offers none. A fault names the format (``sampling.grammar``) or the tool."""
    assert req.sampling.grammar is not None, "a call-or-format grammar needs the client's format"
    offered, _ = offered_tools(req.tools, req.tool_choice)
    if not offered:
        return None
    if tool_format == "harmony":
        return _harmony_call_or_format(req.sampling.grammar, offered)
    index = {t.function.name: i for i, t in enumerate(req.tools or [])}
    calls = tuple((index[t.function.name], json.dumps(call_schema(t))) for t in offered)
    try:
        return call_or_format_grammar(req.sampling.grammar, calls, tool_format, req.parallel_tool_calls)
    except FormatRejected as exc:
        raise RequestRejected("sampling.grammar", f"cannot be compiled: {exc}") from None
    except CallRejected as exc:
        raise RequestRejected(
            f"tools[{exc.index}].function.parameters", f"cannot be compiled: {exc}"
        ) from None


def forces_call(req: GenerateRequest) -> bool:
    """``req`` is a chat request whose tool_choice forces a call ("required", a named function, or
    allowed tools in mode "required"); once admitted, its grammar is that call's."""
    choice = req.tool_choice
    allowed_required = isinstance(choice, AllowedToolsChoice) and choice.allowed_tools.mode == "required"
    forcing = choice == "required" or isinstance(choice, NamedToolChoice) or allowed_required
    return req.messages is not None and forcing


def tool_grammar(req: GenerateRequest, tool_format: ToolFormat = "hermes") -> Grammar | None:
    """The grammar ``req``'s tool_choice forces, None when it forces none (or it is no chat)."""
    if req.messages is None:
        return None
    return forced_call_grammar(req.tools or [], req.tool_choice, tool_format)


def _harmony_call_or_format(text_format: Grammar, offered: list[Tool]) -> Grammar:
    try:
        return harmony_call_or_format(text_format, offered)
    except Exception as exc:  # xgrammar raises RuntimeError (and its own types) on bad input
        raise RequestRejected("sampling.grammar", f"cannot be compiled beside the tools: {exc}") from None


def call_schema(tool: Tool) -> dict[str, Any]:
    """The schema of one call of ``tool``: its name, and arguments valid against its parameters."""
    arguments = tool.function.parameters or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def check_messages(messages: list[ChatMessage]) -> None:
    """Tool results name their call; only an assistant turn with tool calls may lack content."""
    for i, m in enumerate(messages):
        if m.role == "tool" and not m.tool_call_id:
            raise RequestRejected(f"messages[{i}].tool_call_id", "is required on a tool message")
        if m.tool_calls and m.role != "assistant":
            raise RequestRejected(f"messages[{i}].tool_calls", "only assistant messages have tool calls")
        if m.content is None and not m.tool_calls and not m.parts:
            raise RequestRejected(f"messages[{i}].content", "is required unless the message has tool_calls")
        if m.parts is not None and m.content is not None:
            raise RequestRejected(f"messages[{i}].parts", "replace content: give one of them")


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The client's chat template variables, minus any that would override our own arguments."""
    kwargs = kwargs or {}
    clash = sorted(k for k in kwargs if k in _RESERVED_KWARGS or not k.isidentifier())
    if clash:
        raise RequestRejected("chat_template_kwargs", f"may not set {clash}")
    return kwargs
