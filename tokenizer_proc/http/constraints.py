"""OpenAI's ``response_format`` and the ``regex`` / ``ebnf`` extensions (SGLang's spelling) -> the
engine's ``Grammar``.

``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any JSON
object) or ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``
(``strict`` as OpenAI defines it, false by default: see protocol/grammar.py). At most one constraint
per request. Whether a grammar compiles is the engine's check (tokenizer_proc/grammar.py); its
rejection names the field the grammar came from (``grammar_field``).
"""

from __future__ import annotations

import json
from typing import Any

from protocol.grammar import Grammar
from tokenizer_proc.http.errors import bad_param

CONSTRAINT_FIELDS = ("response_format", "regex", "ebnf")


def grammar_of(response_format: dict[str, Any] | None, regex: str | None, ebnf: str | None) -> Grammar | None:
    """The request's one constraint as a Grammar, None for free text; a 400 naming the field for a
    malformed one or for two at once."""
    named = [
        (name, grammar)
        for name, grammar in (
            ("response_format", _response_format(response_format)),
            ("regex", Grammar(kind="regex", spec=regex) if regex is not None else None),
            ("ebnf", Grammar(kind="ebnf", spec=ebnf) if ebnf is not None else None),
        )
        if grammar is not None
    ]
    if len(named) > 1:
        fields = " and ".join(name for name, _ in named)
        raise bad_param(named[1][0], f"give one output constraint, not {fields}")
    return named[0][1] if named else None


def grammar_field(body: Any) -> str:
    """The field a request's grammar came from, as a rejection of the grammar names it."""
    for name in CONSTRAINT_FIELDS[1:]:
        if getattr(body, name, None) is not None:
            return str(name)
    return "response_format"


def _response_format(value: dict[str, Any] | None) -> Grammar | None:
    if value is None:
        return None
    kind = value.get("type")
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra:
        raise bad_param("response_format", f"response_format has unknown fields {extra}")
    match kind:
        case "text":
            return None
        case "json_object":
            return Grammar(kind="json_object")
        case "json_schema":
            return _json_schema(value.get("json_schema"))
    raise bad_param(
        "response_format", f"response_format type must be text, json_object or json_schema, got {kind!r}"
    )


def _json_schema(value: Any) -> Grammar:
    if not isinstance(value, dict):
        raise bad_param("response_format", "response_format json_schema must be an object with a schema")
    schema = value.get("schema")
    if not isinstance(schema, dict):
        raise bad_param("response_format", "response_format json_schema.schema must be a JSON object")
    strict = value.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_param("response_format", "response_format json_schema.strict must be a boolean")
    return Grammar(kind="json_schema", spec=json.dumps(schema), strict=bool(strict))
