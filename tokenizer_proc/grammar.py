"""Compile a request's grammar (protocol/grammar.py) with xgrammar, for the worker's matcher.

Where grammars compile, and why here: the tokenizer process has the tokenizer (xgrammar's
compiled grammar holds a token-mask cache over the vocabulary) and is where a request is still
refusable, so a schema that cannot compile gets an error reply naming the field before anything is
queued. The worker, whose single thread runs every stream's forward, never compiles: a slow compile
there would stall every stream.

Compiles run on a thread pool, off the event loop that relays tokens (xgrammar releases the GIL
while it compiles), once per distinct grammar: finished ones stay in a bounded LRU cache and a
second request for a grammar being compiled waits for the same compile.

How a grammar travels: as xgrammar's own JSON text of the compiled grammar
(``CompiledGrammar.serialize_json``, without the vocabulary) inside ``WorkerSampling.grammar``,
with a key (a hash of the request's Grammar) under which the worker keeps the deserialized grammar.
Plain text on the wire, never a pickle.

JSON grammars (json_schema, json_object) allow no free whitespace: xgrammar's ``any_whitespace=False``
fixes the separators to ``", "`` and ``": "`` on one line, so a small model cannot loop in blanks.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import re
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from protocol.grammar import Grammar
from protocol.sampling import WorkerGrammar
from tokenizer_proc.chat.tool_parsers import CALL_CLOSE, CALL_OPEN

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase

CACHE_ENTRIES = 256
CACHE_BYTES = 256 * 2**20  # a compiled JSON schema serializes to ~50-250 KB for a 49k vocabulary
MAX_SPEC_CHARS = 256 * 1024
COMPILE_THREADS = 2
ANY_JSON_OBJECT = '{"type": "object"}'
# xgrammar's errors start with a time and a C++ source location; the client needs the rest.
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarRejected(ValueError):
    """The grammar cannot be compiled; the message says why (validation names the field)."""


@dataclass(frozen=True)
class CompiledSpec:
    """A compiled grammar as it travels: its key and xgrammar's JSON text of it."""

    key: str
    compiled: str

    def for_request(self, stop_token_ids: list[int], prompt_len: int) -> WorkerGrammar:
        return WorkerGrammar(
            key=self.key, compiled=self.compiled, stop_token_ids=stop_token_ids, prompt_len=prompt_len
        )


def grammar_key(grammar: Grammar) -> str:
    return hashlib.sha256(msgspec.msgpack.encode(grammar)).hexdigest()


class GrammarCompiler:
    """Compiles grammars for the tokenizer's vocabulary on a thread pool, with an LRU cache.

    The xgrammar TokenizerInfo is built on the first compile (on the pool: it reads every token).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
        self._cache: OrderedDict[str, CompiledSpec] = OrderedDict()
        self._cache_bytes = 0
        self._compiling: dict[str, asyncio.Future[CompiledSpec]] = {}
        self._valid_schemas: OrderedDict[str, None] = OrderedDict()  # keys of schemas that converted

    def cached(self, grammar: Grammar) -> CompiledSpec | None:
        key = grammar_key(grammar)
        spec = self._cache.get(key)
        if spec is not None:
            self._cache.move_to_end(key)
        return spec

    async def compile(self, grammar: Grammar) -> CompiledSpec:
        """The compiled grammar, from the cache or compiled on the pool; raise GrammarRejected."""
        spec = self.cached(grammar)
        if spec is not None:
            return spec
        key = grammar_key(grammar)
        running = self._compiling.get(key)
        if running is not None:
            return await asyncio.shield(running)
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, self._compile_now, key, grammar)
        self._compiling[key] = future
        try:
            spec = await asyncio.shield(future)
        finally:
            self._compiling.pop(key, None)
        self._remember(spec)
        return spec

    def schema_checked(self, schema: str) -> bool:
        """``schema`` (JSON text) is known to convert to a grammar."""
        return _schema_key(schema) in self._valid_schemas

    async def check_json_schema(self, schema: str) -> None:
        """Raise GrammarRejected when the JSON schema ``schema`` cannot become a grammar (a tool's
        parameters: refused whether or not a call is forced). Only the conversion, on the pool: no
        token masks, so a few hundred microseconds a schema; those that passed are remembered."""
        key = _schema_key(schema)
        if key not in self._valid_schemas:
            await asyncio.get_running_loop().run_in_executor(self._pool, _check_schema, schema)
            self._valid_schemas[key] = None
        self._valid_schemas.move_to_end(key)
        while len(self._valid_schemas) > CACHE_ENTRIES:
            self._valid_schemas.popitem(last=False)

    def compile_blocking(self, grammar: Grammar) -> CompiledSpec:
        """Compile on the calling thread, through the cache (tests and tools; not the event loop)."""
        spec = self.cached(grammar) or self._compile_now(grammar_key(grammar), grammar)
        self._remember(spec)
        return spec

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _remember(self, spec: CompiledSpec) -> None:
        if spec.key in self._cache:
            return
        self._cache[spec.key] = spec
        self._cache_bytes += len(spec.compiled)
        while len(self._cache) > CACHE_ENTRIES or self._cache_bytes > CACHE_BYTES:
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= len(old.compiled)

    def _compile_now(self, key: str, grammar: Grammar) -> CompiledSpec:
        if len(grammar.spec) > MAX_SPEC_CHARS:
            raise GrammarRejected(f"is {len(grammar.spec)} characters, at most {MAX_SPEC_CHARS}")
        compiler = self._get_compiler()
        try:
            compiled = _compile(compiler, grammar)
        except Exception as exc:  # xgrammar raises RuntimeError (and its own types) on bad input
            raise GrammarRejected(_clean(str(exc))) from exc
        return CompiledSpec(key=key, compiled=compiled.serialize_json())

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        if self._compiler is None:  # a race on the pool builds it twice at worst: both are equal
            import xgrammar

            info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size)
            # xgrammar's own cache off: ours is bounded and keyed by the request's Grammar.
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler


def _schema_key(schema: str) -> str:
    return hashlib.sha256(schema.encode()).hexdigest()


def _check_schema(schema: str) -> None:
    if len(schema) > MAX_SPEC_CHARS:
        raise GrammarRejected(f"is {len(schema)} characters, at most {MAX_SPEC_CHARS}")
    import xgrammar

    try:  # what compile_json_schema does before it builds the token masks
        xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
    except Exception as exc:  # xgrammar raises RuntimeError (and its own types) on bad input
        raise GrammarRejected(_clean(str(exc))) from exc


def _compile(compiler: xgrammar.GrammarCompiler, grammar: Grammar) -> xgrammar.CompiledGrammar:
    if grammar.kind == "json_schema" and not grammar.spec.strip():
        raise GrammarRejected("json_schema needs a schema")
    return compiler.compile_grammar(xgrammar_of(grammar))


def xgrammar_of(grammar: Grammar) -> xgrammar.Grammar:
    """``grammar`` as xgrammar's (not yet compiled for a vocabulary): the one place a kind is read."""
    import xgrammar

    match grammar.kind:
        case "json_schema":
            return xgrammar.Grammar.from_json_schema(
                grammar.spec, any_whitespace=False, strict_mode=grammar.strict
            )
        case "json_object":
            return xgrammar.Grammar.from_json_schema(ANY_JSON_OBJECT, any_whitespace=False, strict_mode=False)
        case "regex":
            return xgrammar.Grammar.from_regex(grammar.spec)
        case "ebnf":
            return xgrammar.Grammar.from_ebnf(grammar.spec)
    raise GrammarRejected(f"unknown grammar kind {grammar.kind!r}")


class FormatRejected(GrammarRejected):
    """The format of a call-or-format grammar cannot be converted."""


class CallRejected(GrammarRejected):
    """The call grammar of tool ``index`` cannot be converted."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


@functools.lru_cache(maxsize=CACHE_ENTRIES)
def call_or_format_grammar(
    text_format: Grammar, calls: tuple[tuple[int, str], ...], tool_format: str, parallel: bool
) -> Grammar:
    """One grammar for a reply that is tool calls in the model's syntax or text in ``text_format``
    (tools offered with tool_choice auto beside response_format): ``calls`` holds (tool index, the
    JSON schema of one call object) per offered tool. ``tool_format``: ``hermes`` calls are
    ``<tool_call>`` blocks, one per line; ``json`` ones bare objects joined by "; " (see
    chat/tool_parsers.py, which reads them back). Built as an xgrammar structural tag ("or" of
    the format and the calls) and carried as its EBNF text, so it is compiled and cached like any
    grammar; a few milliseconds at most for the conversions, once per distinct request (cached).
    Raise FormatRejected or CallRejected."""
    import xgrammar

    try:
        text = _as_format(text_format)
    except Exception as exc:  # xgrammar raises RuntimeError (and its own types) on bad input
        raise FormatRejected(_clean(str(exc))) from exc
    leaves = []
    for index, schema in calls:
        try:
            leaves.append(_as_format(Grammar(kind="json_schema", spec=schema)))
        except Exception as exc:
            raise CallRejected(index, _clean(str(exc))) from exc
    call: dict[str, Any] = leaves[0] if len(leaves) == 1 else {"type": "or", "elements": leaves}
    tag = {
        "type": "structural_tag",
        "format": {"type": "or", "elements": [text, _calls(call, tool_format, parallel)]},
    }
    return Grammar(kind="ebnf", spec=str(xgrammar.Grammar.from_structural_tag(json.dumps(tag))))


def _as_format(grammar: Grammar) -> dict[str, Any]:
    """A structural tag's leaf: xgrammar's own EBNF of the grammar (compact JSON, strictness as set)."""
    return {"type": "grammar", "grammar": str(xgrammar_of(grammar))}


def _calls(call: dict[str, Any], tool_format: str, parallel: bool) -> dict[str, Any]:
    if tool_format == "hermes":
        block = {"type": "tag", "begin": f"{CALL_OPEN}\n", "content": call, "end": f"\n{CALL_CLOSE}"}
        return {"type": "tags_with_separator", "tags": [block], "separator": "\n", "at_least_one": True,
                "stop_after_first": not parallel}  # fmt: skip
    more = {"type": "sequence", "elements": [{"type": "const_string", "value": "; "}, call]}
    return {"type": "sequence", "elements": [call, {"type": "star", "content": more}]} if parallel else call


def _clean(message: str) -> str:
    """xgrammar's error message without its time and source location, on one line, not too long."""
    first = _XGRAMMAR_PREFIX.sub("", message.strip()).splitlines()[0] if message.strip() else "cannot compile"
    return first[:500]
