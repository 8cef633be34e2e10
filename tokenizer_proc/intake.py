"""The tokenizer's intake: how a generate request gets into the engine, one path for both front doors
(ZMQ and HTTP).

    begin    the forced tool call's grammar put in ``sampling.grammar`` (here, and nowhere else);
             the grammar and the tools' parameters schemas looked up in the compiler's caches
    compile  what was not cached: every tool's parameters schema checked and the grammar compiled,
             on the compiler's threads (grammar.py), off the event loop
    start    refused while draining or when its rid is in flight; validated and tokenized
             (validation.py), tracked (request_table.py), routed to a replica (router.py)

``Intake.admit`` runs compile then start; ``start`` alone serves a request ``begin`` found with
nothing to compile. A ZMQ request is begun as its frame is read and started at once when it can be;
otherwise the process awaits ``admit`` for it as a task while its loop serves on
(``Frontend.admit_after_compile``), and an abort or shutdown meanwhile ends it (``Admitting.ended``).
An HTTP request (http/bridge.py) is begun and admitted in its handler. Every refusal raises
RequestRejected naming the field: the ZMQ door answers it as an error reply, the HTTP door as
OpenAI's error (http/convert.py, ``rejection_error``).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from protocol.messages import GenerateRequest, TokenizedRequest
from tokenizer_proc.chat.template import template_traits
from tokenizer_proc.chat.tool_checks import forces_call, parameters_json, with_tool_grammar
from tokenizer_proc.grammar import CompiledSpec, GrammarCompiler, GrammarRejected
from tokenizer_proc.model_info import ModelInfo
from tokenizer_proc.router import Router
from tokenizer_proc.validation import RequestRejected, validate_generate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tokenizer_proc.request_table import RequestTable

logger = logging.getLogger(__name__)

SHUTDOWN_MESSAGE = "engine is shutting down"
SHUTTING_DOWN = "shutting_down"  # RequestRejected.code of a request refused while draining


@dataclass
class Admitting:
    """A request on its way in, from ``begin`` until it starts or is refused."""

    client_id: bytes
    req: GenerateRequest  # with its forced tool call's grammar
    forced: bool  # its grammar is a forced tool call's: a fault of it is tool_choice's
    clamp_to_context: bool  # see validate_generate
    compiled: bool  # nothing left to compile: its grammar, when it has one, is in ``grammar``
    grammar: CompiledSpec | None = None
    ended: bool = False  # aborted or failed (and answered) while it compiled: never started now

    @property
    def key(self) -> tuple[bytes, str]:
        return self.client_id, self.req.rid


class Intake:
    """Begins, compiles, validates, tracks and routes requests for both front doors.

    ``seed`` seeds the generator of per-request sampling seeds, so a run with the same requests in
    the same order samples the same tokens.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        info: ModelInfo,
        seed: int,
        requests: RequestTable,
        router: Router,
    ) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.requests = requests
        self.router = router
        self.grammars = GrammarCompiler(tokenizer, info.vocab_size)
        self.chat_traits = template_traits(tokenizer)  # what the chat template does with tools, <think>
        self.draining = False  # set at shutdown: running requests finish, new ones are refused
        self._rng = random.Random(seed)

    def begin(self, client_id: bytes, req: GenerateRequest, *, clamp_to_context: bool = True) -> Admitting:
        """``req`` with its forced tool call's grammar, before anything looks at its grammar; what
        the compiler has of it already. Raise RequestRejected (a bad tool)."""
        req = with_tool_grammar(req, self.chat_traits.tool_format)
        grammar = None if req.sampling.grammar is None else self.grammars.cached(req.sampling.grammar)
        schemas_checked = all(self.grammars.schema_checked(schema) for _, schema in tool_schemas(req))
        return Admitting(
            client_id=client_id,
            req=req,
            forced=forces_call(req),
            clamp_to_context=clamp_to_context,
            compiled=schemas_checked and (req.sampling.grammar is None or grammar is not None),
            grammar=grammar,
        )

    async def admit(self, pending: Admitting) -> TokenizedRequest | None:
        """Compile what ``begin`` did not find (off the event loop), then ``start``; None when the
        request ended meanwhile (its reply went out then). Raise RequestRejected."""
        if not pending.compiled:
            pending.grammar = await self._compile(pending)
            pending.compiled = True
        if pending.ended:
            return None
        return self.start(pending)

    def start(self, pending: Admitting) -> TokenizedRequest:
        """Validate and tokenize the compiled request, track it and route it: what goes to its
        replica's scheduler. Raise RequestRejected."""
        assert pending.compiled, "a request starts once its grammar and tool schemas are compiled"
        client_id, req = pending.client_id, pending.req
        if self.draining:
            raise RequestRejected(None, SHUTDOWN_MESSAGE, SHUTTING_DOWN)
        self.requests.check_new_rid(client_id, req.rid)
        try:
            valid = validate_generate(
                req,
                self.tokenizer,
                self.info,
                self._rng,
                pending.grammar,
                traits=self.chat_traits,
                clamp_to_context=pending.clamp_to_context,
            )
        except RequestRejected:
            raise
        except Exception as exc:  # a tokenizer bug on one odd input must not take the engine down
            logger.exception("request %r failed in tokenization", req.rid)
            raise RequestRejected(None, f"tokenization failed: {exc!r}") from exc
        tokenized = self.requests.add(client_id, valid)
        self.router.route(tokenized.rid, tokenized.n, valid.input_ids, valid.cache_salt, valid.max_new_tokens)
        return tokenized

    async def _compile(self, pending: Admitting) -> CompiledSpec | None:
        """Check that every tool's parameters schema compiles, whatever the tool_choice, then compile
        the request's grammar (once per distinct one); None when it has none. Raise RequestRejected
        naming the tool's parameters, or ``sampling.grammar`` (``tool_choice`` for a forced call's)."""
        req = pending.req
        for i, schema in tool_schemas(req):
            try:
                await self.grammars.check_json_schema(schema)
            except GrammarRejected as exc:
                raise RequestRejected(
                    f"tools[{i}].function.parameters", f"cannot be compiled: {exc}"
                ) from None
        if req.sampling.grammar is None:
            return None
        try:
            return await self.grammars.compile(req.sampling.grammar)
        except GrammarRejected as exc:
            param = "tool_choice" if pending.forced else "sampling.grammar"
            raise RequestRejected(param, f"cannot be compiled: {exc}") from None
        except Exception as exc:  # a compiler fault on one odd grammar must not take the engine down
            logger.exception("request %r: compiling its grammar failed", req.rid)
            raise RequestRejected("sampling.grammar", f"could not be compiled: {exc!r}") from exc


def tool_schemas(req: GenerateRequest) -> list[tuple[int, str]]:
    """(index, JSON text) of each tool's parameters schema, of a chat request (what else has tools
    is refused in validation)."""
    if req.messages is None:
        return []
    return [(i, schema) for i, tool in enumerate(req.tools or []) if (schema := parameters_json(i, tool))]
