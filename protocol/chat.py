"""Chat messages, tools and tool calls as a client sends them and the engine answers them.

Shaped like OpenAI's chat API so the HTTP layer maps them one to one. A tool's ``parameters``
(a JSON schema) travels as a plain map; a call's ``arguments`` as JSON text, as OpenAI has it.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

# mypy takes a subclass that does not repeat frozen=True for non-frozen; msgspec inherits it
# (as in messages.py).
# mypy: disable-error-code="misc"


class ClientStruct(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of the client-facing structs here: unknown fields are an error, as in messages.py."""


class FunctionCall(ClientStruct, kw_only=True):
    name: str
    arguments: str  # JSON text of the arguments object, as the model wrote it


class ToolCall(ClientStruct, kw_only=True):
    """A call the assistant made: in a reply, and in the history sent back with the tool's result."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(ClientStruct, kw_only=True, tag_field="type", tag="text"):
    text: str


class ImagePart(ClientStruct, kw_only=True, tag_field="type", tag="image"):
    """An image in a message: its file's bytes (PNG, JPEG, WebP or GIF's first frame), or the path
    of a local file, read only under the directory the operator allows (--allowed-local-media-path)."""

    data: bytes | None = None
    path: str | None = None


ContentPart = TextPart | ImagePart


class ChatMessage(ClientStruct, kw_only=True):
    """One turn. ``content`` may be None on an assistant turn that only calls tools; a ``tool``
    turn carries the result of the call ``tool_call_id``. ``parts``: a turn with images, its text
    and images in order (``content`` is then None). ``reasoning``: an assistant turn's reasoning as
    the client sent it back (shown to harmony models, which reason across their tool calls)."""

    role: str
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    parts: list[ContentPart] | None = None
    reasoning: str | None = None


class FunctionDef(ClientStruct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(ClientStruct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(ClientStruct, kw_only=True):
    name: str


class NamedToolChoice(ClientStruct, kw_only=True, tag_field="type", tag="function"):
    """``tool_choice`` that forces one function: ``{"type": "function", "function": {"name": ...}}``."""

    function: NamedFunction


class AllowedTool(ClientStruct, kw_only=True):
    """A tool ``allowed_tools`` lists, by name (a client may send its whole definition: only the
    name counts)."""

    type: Literal["function"] = "function"
    function: FunctionDef


class AllowedTools(ClientStruct, kw_only=True):
    mode: Literal["auto", "required"]
    tools: list[AllowedTool]


class AllowedToolsChoice(ClientStruct, kw_only=True, tag_field="type", tag="allowed_tools"):
    """``tool_choice`` that offers only the listed tools, called freely (``auto``) or at least once
    (``required``): ``{"type": "allowed_tools", "allowed_tools": {"mode": ..., "tools": [...]}}``.
    The other tools stay defined but are not offered (so a client can keep its tool list fixed)."""

    allowed_tools: AllowedTools


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice | AllowedToolsChoice


class ToolCallDelta(ClientStruct, kw_only=True):
    """A piece of tool call ``index`` in a reply. Streamed: the first piece of a call has ``id``
    and ``name`` (and maybe arguments), later ones only argument text; the arguments of a call are
    the concatenation of its pieces. A whole reply has one piece per call, complete."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""
