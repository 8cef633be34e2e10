"""A harmony (gpt-oss) chat request's prompt side: its history as the model's template takes it,
its reasoning effort, and the grammars of a forced call and of calls beside a response format.

Rendering is the model's own chat template's (it writes the system and developer messages, the
tools as TypeScript, past calls and results); what is ours is only what that template cannot take:

- gpt-oss makes one call per assistant message and refuses more, and names a result by the call
  just before it. An assistant turn with several calls (a client's parallel calls) is rendered as
  one message per call, each followed by its own results.
- gpt-oss knows the efforts low, medium and high: OpenAI's others are mapped to the nearest.

A forced call (tool_choice "required", a named function) is a grammar of harmony's call message,
``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`` and the arguments' JSON,
after which the grammar ends the reply (an end id: ``<|call|>``). An analysis message may come
first, as gpt-oss reasons before it calls (its text without ``<``, so that only ``<|end|>`` ends it).
"""

from __future__ import annotations

import functools
import json
from typing import Any

from protocol.chat import ChatMessage, Tool
from protocol.grammar import Grammar
from tokenizer_proc.chat.harmony_tokens import CHANNEL, CONSTRAIN, END, FUNCTIONS, MESSAGE, START

_EFFORTS = {
    "none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"
}  # fmt: skip


def harmony_turns(messages: list[ChatMessage]) -> list[ChatMessage]:
    """``messages`` with every assistant turn of several calls split into one turn per call, each
    followed by the results that answer it (results that answer none of them follow the last)."""
    out: list[ChatMessage] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        i += 1
        if m.role != "assistant" or not m.tool_calls or len(m.tool_calls) == 1:
            out.append(m)
            continue
        results: list[ChatMessage] = []
        while i < len(messages) and messages[i].role == "tool":
            results.append(messages[i])
            i += 1
        for k, call in enumerate(m.tool_calls):
            said = (m.content, m.reasoning) if k == 0 else (None, None)  # the turn's text goes first
            out.append(
                ChatMessage(
                    role="assistant", content=said[0], tool_calls=[call], name=m.name, reasoning=said[1]
                )
            )
            out += [r for r in results if r.tool_call_id == call.id]
        answered = {call.id for call in m.tool_calls}
        out += [r for r in results if r.tool_call_id not in answered]
    return out


def harmony_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The template variables with ``reasoning_effort`` as one gpt-oss knows (others unchanged)."""
    effort = kwargs.get("reasoning_effort")
    if isinstance(effort, str) and effort in _EFFORTS:
        return {**kwargs, "reasoning_effort": _EFFORTS[effort]}
    return kwargs


def call_header(name: str) -> str:
    """The header of a call message as gpt-oss writes it, after the prompt's ``<|start|>assistant``."""
    return f"{CHANNEL}commentary to={FUNCTIONS}{name} {CONSTRAIN}json{MESSAGE}"


def harmony_call_grammar(tools: list[Tool]) -> Grammar:
    """The grammar of one call message to one of ``tools`` (arguments valid against its schema),
    maybe after an analysis message."""
    calls = _calls_format(tools)
    analysis = [
        {"type": "const_string", "value": f"{CHANNEL}analysis{MESSAGE}"},
        {"type": "grammar", "grammar": "root ::= [^<]+"},
        {"type": "const_string", "value": f"{END}{START}assistant"},
    ]
    return _structural(
        {"type": "or", "elements": [{"type": "sequence", "elements": [*analysis, calls]}, calls]}
    )


def harmony_call_or_format(text_format: Grammar, tools: list[Tool]) -> Grammar:
    """A reply that is one call message to one of ``tools``, or text in ``text_format`` (written
    bare, which the parser reads as content)."""
    return _structural({"type": "or", "elements": [_leaf(text_format), _calls_format(tools)]})


def _calls_format(tools: list[Tool]) -> dict[str, Any]:
    calls = []
    for tool in tools:
        arguments = tool.function.parameters or {"type": "object", "properties": {}}
        schema = Grammar(kind="json_schema", spec=json.dumps(arguments))
        header = {"type": "const_string", "value": call_header(tool.function.name)}
        calls.append({"type": "sequence", "elements": [header, _leaf(schema)]})
    return calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}


def _leaf(grammar: Grammar) -> dict[str, Any]:
    return {"type": "grammar", "grammar": _ebnf_of(grammar)}


# Built as a request begins, on the event loop: the conversions (a millisecond or a few) are cached
# per distinct schema and per distinct whole grammar, as call_or_format_grammar's are.
@functools.lru_cache(maxsize=256)
def _ebnf_of(grammar: Grammar) -> str:
    from tokenizer_proc.grammar import xgrammar_of

    return str(xgrammar_of(grammar))


def _structural(format_: dict[str, Any]) -> Grammar:
    return Grammar(
        kind="ebnf", spec=_structural_ebnf(json.dumps({"type": "structural_tag", "format": format_}))
    )


@functools.lru_cache(maxsize=256)
def _structural_ebnf(tag: str) -> str:
    import xgrammar

    return str(xgrammar.Grammar.from_structural_tag(tag))
