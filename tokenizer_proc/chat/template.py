"""Chat requests -> the prompt text: tools, tool calls and tool results put where the model's chat
template can take them, and what the reply's parser must know (``ChatOutputPlan``).

What a template can take is probed once per model (``template_traits``). A template that ignores
``tools`` (SmolLM2's) gets them in the system message in rivulet's Hermes-style format
(``TOOL_SYSTEM_PROMPT``); a template that never mentions ``tool_calls`` gets the history's calls
and results as text in the same format, so templates that concatenate string content never see
None or a list.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from protocol.chat import ChatMessage, TextPart, Tool
from tokenizer_proc.chat.harmony_prompt import harmony_kwargs, harmony_turns
from tokenizer_proc.chat.harmony_tokens import HarmonyTokens, harmony_tokens
from tokenizer_proc.chat.reasoning import THINK_CLOSE, THINK_OPEN
from tokenizer_proc.chat.tool_checks import check_messages, check_template_kwargs, offered_tools
from tokenizer_proc.chat.tool_parsers import CALL_CLOSE, CALL_OPEN, PYTHON_TAG, ToolFormat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from protocol.messages import GenerateRequest

TOOL_SYSTEM_PROMPT = (
    "You can call functions. The functions available, as JSON signatures, are within "
    "<tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with a JSON object of its name and arguments within "
    "<tool_call></tool_call> tags, one per call:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <arguments-json-object>}}\n</tool_call>'
)
# Markers in a chat template's text -> the tool-call format its model writes (first match wins);
# anything else writes Hermes-style calls (what the fallback prompt asks for).
_FORMAT_MARKERS: tuple[tuple[str, ToolFormat], ...] = ((CALL_OPEN, "hermes"), (PYTHON_TAG, "json"))
_PROBE_PARAMETERS = {"type": "object", "properties": {}}
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_fn", "parameters": _PROBE_PARAMETERS}}


@dataclass(frozen=True)
class ChatTemplateTraits:
    """What the model's chat template does with tools and reasoning, probed once per model."""

    takes_tools: bool  # renders the ``tools`` argument itself
    takes_tool_calls: bool  # renders assistant ``tool_calls`` and ``tool`` messages itself
    tool_format: ToolFormat  # how the model writes its calls
    thinks: bool  # the template knows <think> blocks: split reasoning out of replies
    harmony: HarmonyTokens | None = None  # gpt-oss's harmony format (chat/harmony*.py)


@dataclass(frozen=True)
class ChatOutputPlan:
    """How a chat reply is parsed: tools offered (None: no tool parsing), and reasoning."""

    tool_format: ToolFormat | None
    tool_names: frozenset[str]
    reasoning: bool  # split <think>...</think> out of the reply
    starts_in_reasoning: bool  # the prompt ended inside an open think block
    first_call_only: bool = False  # parallel_tool_calls false: calls after the first are dropped
    harmony: HarmonyTokens | None = None  # the reply is harmony messages, parsed from its token ids


def template_traits(tokenizer: PreTrainedTokenizerBase) -> ChatTemplateTraits:
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    probe = [{"role": "user", "content": "hi"}]
    try:
        plain = _render(tokenizer, probe, None, {})
        takes_tools = _render(tokenizer, probe, [_PROBE_TOOL], {}) != plain
    except Exception:  # a template that cannot even render the probe: it takes nothing of ours
        takes_tools = False
    fmt: ToolFormat = "hermes"
    if takes_tools:
        fmt = next((f for marker, f in _FORMAT_MARKERS if marker in template), "hermes")
    harmony = harmony_tokens(tokenizer)
    return ChatTemplateTraits(
        takes_tools=takes_tools,
        takes_tool_calls="tool_calls" in template,
        tool_format="harmony" if harmony is not None else fmt,
        thinks=THINK_OPEN in template,
        harmony=harmony,
    )


def render_chat(
    req: GenerateRequest, tokenizer: PreTrainedTokenizerBase, traits: ChatTemplateTraits
) -> tuple[str, ChatOutputPlan]:
    """The prompt text of a chat request and its reply's plan; raises RequestRejected (via the
    checks) naming the field at fault."""
    assert req.messages is not None, "render_chat needs messages"
    check_messages(req.messages)
    kwargs = check_template_kwargs(req.chat_template_kwargs)
    tools, forced = offered_tools(req.tools, req.tool_choice)
    if traits.harmony is not None:
        return _render_harmony(req, tokenizer, traits.harmony, kwargs, tools)
    conversation = _conversation(req.messages, traits)
    tool_dicts = [_tool_dict(t) for t in tools] if tools else None
    if tool_dicts and not traits.takes_tools:
        conversation = _with_tool_system_prompt(conversation, tool_dicts)
        tool_dicts = None
    text = _render(tokenizer, conversation, tool_dicts, kwargs)
    # A forced call's grammar makes the reply the bare call object, and a call-or-format grammar
    # (tools beside a grammar) calls or text in the format, even after an open <think>.
    constrained = forced or bool(tools and req.sampling.grammar is not None)
    plan = ChatOutputPlan(
        tool_format=("json" if forced else traits.tool_format) if tools else None,
        tool_names=frozenset(t.function.name for t in tools),
        reasoning=traits.thinks and not constrained,
        starts_in_reasoning=traits.thinks and not constrained and _ends_inside_think(text),
        first_call_only=not req.parallel_tool_calls,
    )
    return text, plan


def _render_harmony(
    req: GenerateRequest,
    tokenizer: PreTrainedTokenizerBase,
    harmony: HarmonyTokens,
    kwargs: dict[str, Any],
    tools: list[Tool],
) -> tuple[str, ChatOutputPlan]:
    """A harmony model's prompt, through its own template (which takes tools and tool calls), and
    its reply's plan: the harmony parser, whatever grammar the request has (see harmony_prompt.py)."""
    assert req.messages is not None, "_render_harmony needs messages"
    conversation = [_with_thinking(m) for m in harmony_turns(req.messages)]
    tool_dicts = [_tool_dict(t) for t in tools] if tools else None
    text = _render(tokenizer, conversation, tool_dicts, harmony_kwargs(kwargs))
    plan = ChatOutputPlan(
        tool_format=None,
        tool_names=frozenset(t.function.name for t in tools),
        reasoning=True,
        starts_in_reasoning=False,
        first_call_only=not req.parallel_tool_calls,
        harmony=harmony,
    )
    return text, plan


def _with_thinking(m: ChatMessage) -> dict[str, Any]:
    """A harmony turn with its reasoning as gpt-oss's template takes it (``thinking``); a call's turn
    takes thinking or content, not both, and renders either as analysis: they are joined."""
    d = _structured(m)
    if m.reasoning:
        d["thinking"] = m.reasoning
        if m.tool_calls and m.content:
            d["thinking"], d["content"] = f"{m.reasoning}\n\n{m.content}", ""
    return d


def _render(
    tokenizer: PreTrainedTokenizerBase,
    conversation: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any],
) -> str:
    tool_list: list[Any] | None = list(tools) if tools is not None else None
    text = tokenizer.apply_chat_template(
        conversation, tools=tool_list, add_generation_prompt=True, tokenize=False, **kwargs
    )
    assert isinstance(text, str), f"apply_chat_template(tokenize=False) gave {type(text).__name__}"
    return text


def _ends_inside_think(prompt: str) -> bool:
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def _tool_dict(tool: Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.function.name}
    if tool.function.description is not None:
        function["description"] = tool.function.description
    function["parameters"] = tool.function.parameters or {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def _with_tool_system_prompt(
    conversation: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    block = TOOL_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
    if conversation and conversation[0]["role"] == "system":
        first = {**conversation[0], "content": f"{conversation[0]['content']}\n\n{block}"}
        return [first, *conversation[1:]]
    return [{"role": "system", "content": block}, *conversation]


def _conversation(messages: list[ChatMessage], traits: ChatTemplateTraits) -> list[dict[str, Any]]:
    """The messages as the template gets them: tool calls and results structured when it takes
    them, else as Hermes-style text (consecutive tool results in one user turn)."""
    if traits.takes_tool_calls:
        return [_structured(m) for m in messages]
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.role == "tool":
            response = f"<tool_response>\n{m.content or ''}\n</tool_response>"
            if i > 0 and messages[i - 1].role == "tool":  # the previous result's turn is the last one
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
        elif m.parts is not None:
            out.append({"role": m.role, "content": _content_of(m)})
        else:
            calls = [_call_text(c.function.name, c.function.arguments) for c in m.tool_calls or []]
            content = "\n".join([m.content, *calls] if m.content else calls)  # as sent when no calls
            out.append({"role": m.role, "content": content})
    return out


def _content_of(m: ChatMessage) -> str | list[dict[str, Any]]:
    """A turn's content as templates take it: text, or with images text and image items (HF's
    convention for multimodal templates)."""
    parts = m.parts
    if parts is None or all(isinstance(part, TextPart) for part in parts):
        return "".join(part.text for part in parts or [] if isinstance(part, TextPart)) or m.content or ""
    return [
        {"type": "text", "text": part.text} if isinstance(part, TextPart) else {"type": "image"}
        for part in parts
    ]


def _structured(m: ChatMessage) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": _content_of(m)}
    if m.tool_calls:
        d["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": _arguments_value(c.function.arguments)}}
            for c in m.tool_calls
        ]  # fmt: skip
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        d["name"] = m.name
    return d


def _arguments_value(arguments: str) -> Any:
    """Templates expect a call's arguments as a mapping (HF's convention); JSON text that is not
    an object stays text."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _call_text(name: str, arguments: str) -> str:
    call = json.dumps({"name": name, "arguments": _arguments_value(arguments)})
    return f"{CALL_OPEN}\n{call}\n{CALL_CLOSE}"
