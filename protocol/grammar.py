"""A constraint on what a request may generate: a JSON schema, any JSON object, a regex or an EBNF
grammar, carried as plain text in SamplingParams (the ZMQ client sets it; the HTTP API fills it
from ``response_format``, ``regex``, ``ebnf`` and forced tool choices)."""

from __future__ import annotations

from typing import Literal

import msgspec

GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf"]


class Grammar(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``spec``: the schema as JSON text (json_schema), the pattern (regex), the grammar (ebnf);
    empty for json_object (any JSON object)."""

    kind: GrammarKind
    spec: str = ""
