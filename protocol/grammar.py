"""A constraint on what a request may generate: a JSON schema, any JSON object, a regex or an EBNF
grammar, carried as plain text in SamplingParams (the ZMQ client sets it; the HTTP API fills it
from ``response_format``, ``regex``, ``ebnf`` and forced tool choices)."""

from __future__ import annotations

from typing import Literal

import msgspec

GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf"]


class Grammar(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``spec``: the schema as JSON text (json_schema), the pattern (regex), the grammar (ebnf, its
    start rule named ``root``); empty for json_object (any JSON object).

    ``strict`` (json_schema only): True allows no property or array item the schema does not list
    (OpenAI's ``strict: true``); False reads the schema as JSON Schema does (``additionalProperties``
    allowed unless the schema forbids them). Either way the output is valid JSON for the schema.
    """

    kind: GrammarKind
    spec: str = ""
    strict: bool = True
