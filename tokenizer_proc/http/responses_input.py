"""A Responses API body -> the engine's chat GenerateRequest.

``input`` (a string, or items: messages, ``function_call`` and ``function_call_output``, reasoning)
becomes chat messages after the stored history of ``previous_response_id`` and the
``instructions`` (a system message; a previous response's instructions are not carried over, as
OpenAI documents). Function tools, ``tool_choice`` and ``text.format`` map to what chat
completions use (protocol/chat.py's tools, a grammar); ``reasoning.effort`` is a template variable.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from protocol.chat import (
    AllowedTool,
    AllowedTools,
    AllowedToolsChoice,
    ChatMessage,
    ContentPart,
    FunctionCall,
    FunctionDef,
    NamedFunction,
    NamedToolChoice,
    TextPart,
    Tool,
    ToolCall,
)
from protocol.chat import ToolChoice as ToolChoice
from protocol.grammar import Grammar
from protocol.messages import GenerateRequest, SamplingParams
from tokenizer_proc.http.chat_fields import effort_kwargs
from tokenizer_proc.http.convert import UNTIL_CONTEXT
from tokenizer_proc.http.errors import bad_param
from tokenizer_proc.http.image_parts import image_part
from tokenizer_proc.http.responses_schema import (
    LOGPROBS_INCLUDE,
    AllowedToolsIn,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolIn,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    convert_item,
)

MESSAGE_ROLES = {"user", "assistant", "system", "developer"}
TEXT_PARTS = {"input_text", "output_text", "text"}  # a message's text parts, as sent or as output


def generate_request(body: ResponsesRequest, rid: str, history: list[ChatMessage]) -> GenerateRequest:
    """The chat request of ``body`` continuing ``history`` (the messages of its previous response)."""
    if body.input is None:
        raise bad_param("input", "input is required")
    instructions = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    tools = function_tools(body.tools)
    choice = tool_choice(body.tool_choice, tools)
    logprobs = LOGPROBS_INCLUDE in (body.include or []) or bool(body.top_logprobs)
    return GenerateRequest(
        rid=rid,
        messages=instructions + history + input_messages(body.input),
        sampling=_sampling(body),
        stream=bool(body.stream),
        logprobs=logprobs,
        top_logprobs=body.top_logprobs or 0,
        tools=tools or None,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        chat_template_kwargs=_template_kwargs(body),
    )


def without_oldest_item(req: GenerateRequest, kept: int) -> GenerateRequest | None:
    """``req`` without its oldest conversation item after the first ``kept`` messages (the
    instructions), and without the results of calls it drops (a tool message must follow its
    call); None when only one item is left to drop. ``truncation: "auto"``'s step."""
    assert req.messages is not None, "a Responses request is a chat request"
    rest = req.messages[kept + 1 :]
    while rest and rest[0].role == "tool":
        rest = rest[1:]
    if not rest:
        return None
    return msgspec.structs.replace(req, messages=req.messages[:kept] + rest)


def responses_param(param: str) -> str:
    """A chat-side field name as the Responses API spells it."""
    if param.startswith("messages"):
        return "input"
    param = param.replace("tool_choice.allowed_tools.", "tool_choice.")  # Responses' form is flat
    return param.replace(".function.", ".")  # tools[1].function.name -> tools[1].name


def input_messages(value: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """``input`` as chat messages: a function_call joins the assistant turn before it (or starts
    one), a function_call_output is a tool message; a reasoning item's text goes with the assistant
    turn after it (``ChatMessage.reasoning``: only harmony models are shown it)."""
    if isinstance(value, str):
        return [ChatMessage(role="user", content=value)]
    if not value:
        raise bad_param("input", "input must not be empty")
    messages: list[ChatMessage] = []
    reasoning: str | None = None
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        match kind:
            case "message":
                messages.append(_message(convert_item(item, MessageItem, f"input[{i}]"), i))
            case "function_call":
                _add_call(messages, convert_item(item, FunctionCallItem, f"input[{i}]"))
            case "function_call_output":
                out = convert_item(item, FunctionCallOutputItem, f"input[{i}]")
                content = _text_of(out.output, f"input[{i}].output")
                messages.append(ChatMessage(role="tool", content=content, tool_call_id=out.call_id))
            case "reasoning":
                reasoning = _reasoning_text(convert_item(item, ReasoningItem, f"input[{i}]"))
            case other:
                raise bad_param(f"input[{i}].type", f"input items of type {other!r} are not supported")
        if kind != "reasoning" and reasoning is not None:  # it was this turn's, if an assistant's
            if messages[-1].role == "assistant":
                messages[-1] = msgspec.structs.replace(messages[-1], reasoning=reasoning)
            reasoning = None
    return messages


def _reasoning_text(item: ReasoningItem) -> str | None:
    """A reasoning item's text (its ``reasoning_text`` parts, as rivulet answers them), if any."""
    texts = [
        p["text"]
        for p in item.content or []
        if p.get("type") == "reasoning_text" and isinstance(p.get("text"), str)
    ]
    return "".join(texts) or None


def _message(item: MessageItem, i: int) -> ChatMessage:
    if item.role not in MESSAGE_ROLES:
        raise bad_param(
            f"input[{i}].role", f"unknown role {item.role!r}; expected one of {sorted(MESSAGE_ROLES)}"
        )
    role = "system" if item.role == "developer" else item.role
    if not isinstance(item.content, str) and any(p.get("type") == "input_image" for p in item.content):
        return ChatMessage(
            role=role, parts=[_part(p, f"input[{i}].content[{j}]") for j, p in enumerate(item.content)]
        )
    content = item.content if isinstance(item.content, str) else _text_of(item.content, f"input[{i}].content")
    return ChatMessage(role=role, content=content)


def _part(part: dict[str, Any], param: str) -> ContentPart:
    """A content part of a message with images: its text, or its image (``image_url``: a data URI)."""
    if part.get("type") == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str):
            raise bad_param(f"{param}.image_url", "must be a data: URI (file_id is not supported)")
        return image_part(url, f"{param}.image_url")
    text = part.get("text")
    if part.get("type") not in TEXT_PARTS or not isinstance(text, str):
        raise bad_param(
            param, f"only text and input_image parts are supported, got type {part.get('type')!r}"
        )
    return TextPart(text=text)


def _text_of(content: str | list[dict[str, Any]], param: str) -> str:
    """The text of content parts (text only; a refusal part counts as its text)."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        text = part.get("refusal" if kind == "refusal" else "text")
        if (kind not in TEXT_PARTS and kind != "refusal") or not isinstance(text, str):
            raise bad_param(f"{param}[{j}]", f"only text content parts are supported, got type {kind!r}")
        texts.append(text)
    return "".join(texts)


def _add_call(messages: list[ChatMessage], item: FunctionCallItem) -> None:
    call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant":  # the same turn's text or earlier calls
        calls = [*(last.tool_calls or []), call]
        messages[-1] = msgspec.structs.replace(last, content=last.content or None, tool_calls=calls)
    else:
        messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))


def function_tools(tools: list[dict[str, Any]] | None) -> list[Tool]:
    """Function tools as chat's Tool; any other kind (web_search, file_search, mcp, ...) is a 400."""
    out = []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type")
        if kind != "function":
            raise bad_param(f"tools[{i}].type", f"only function tools are supported, got {kind!r}")
        spec = convert_item(tool, FunctionToolIn, f"tools[{i}]")
        function = FunctionDef(
            name=spec.name, description=spec.description, parameters=spec.parameters, strict=spec.strict
        )
        out.append(Tool(function=function))
    return out


def tool_choice(value: str | dict[str, Any] | None, tools: list[Tool]) -> ToolChoice:
    """``auto`` (the default), ``none``, ``required``, ``{"type": "function", "name": ...}`` or
    ``{"type": "allowed_tools", "mode": ..., "tools": [{"type": "function", "name": ...}, ...]}``
    (whether the listed tools exist is the engine's check, tool_checks.py)."""
    if value is None:
        return "auto"
    if value != "none" and not tools:
        raise bad_param("tool_choice", "tool_choice needs tools")
    if value in ("auto", "none", "required"):
        return value  # type: ignore[return-value]  # narrowed by the membership test
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        if set(value) - {"type", "name"}:
            raise bad_param("tool_choice", f"unknown fields {sorted(set(value) - {'type', 'name'})}")
        return NamedToolChoice(function=NamedFunction(name=value["name"]))
    if isinstance(value, dict) and value.get("type") == "allowed_tools":
        spec = convert_item(value, AllowedToolsIn, "tool_choice")
        listed = [_allowed_tool(j, tool) for j, tool in enumerate(spec.tools)]
        return AllowedToolsChoice(allowed_tools=AllowedTools(mode=spec.mode, tools=listed))
    raise bad_param(
        "tool_choice",
        'tool_choice must be "auto", "none", "required", {"type": "function", "name": ...} '
        'or {"type": "allowed_tools", "mode": ..., "tools": [...]}',
    )


def _allowed_tool(j: int, tool: dict[str, Any]) -> AllowedTool:
    """One tool of ``allowed_tools``: a function, by name (the rest of a definition sent whole is
    not read: the tool is defined in ``tools``)."""
    name = tool.get("name")
    if tool.get("type") != "function" or not isinstance(name, str):
        raise bad_param(f"tool_choice.tools[{j}]", 'must be {"type": "function", "name": ...}')
    return AllowedTool(function=FunctionDef(name=name))


def text_grammar(body: ResponsesRequest) -> Grammar | None:
    """``text.format`` as a grammar: none for ``text``, any object, or the JSON schema."""
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Grammar(kind="json_object")
    if fmt.type != "json_schema":
        raise bad_param("text.format.type", f"must be text, json_object or json_schema, got {fmt.type!r}")
    if fmt.schema is None:
        raise bad_param("text.format.schema", "a json_schema format needs a schema")
    return Grammar(kind="json_schema", spec=json.dumps(fmt.schema), strict=bool(fmt.strict))


def _sampling(body: ResponsesRequest) -> SamplingParams:
    defaults = SamplingParams()
    return SamplingParams(
        max_new_tokens=body.max_output_tokens if body.max_output_tokens is not None else UNTIL_CONTEXT,
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        top_p=defaults.top_p if body.top_p is None else body.top_p,
        grammar=text_grammar(body),
    )


def _template_kwargs(body: ResponsesRequest) -> dict[str, Any] | None:
    """``reasoning.effort`` as template variables, as chat's ``reasoning_effort``."""
    return effort_kwargs(body.reasoning.effort if body.reasoning is not None else None) or None
