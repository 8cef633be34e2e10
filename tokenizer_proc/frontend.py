"""The tokenizer process's logic without its sockets: frames in, an Outbox of messages out."""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING

import msgspec

from protocol.messages import (
    AbortRequest,
    ClientRequest,
    EngineStats,
    FinishReason,
    FlushCacheRequest,
    FlushPrefixCache,
    GenerateOutput,
    GenerateRequest,
    RequestError,
    TokenBatch,
    TokenizedRequest,
    ToScheduler,
    ToTokenizer,
)
from protocol.transport import Codec
from tokenizer_proc.grammar import CompiledSpec, GrammarCompiler, GrammarRejected
from tokenizer_proc.model_info import ModelInfo
from tokenizer_proc.request_state import Outbox, RequestTable, error_output
from tokenizer_proc.router import Router
from tokenizer_proc.tool_checks import parameters_json, tool_grammar, with_tool_grammar
from tokenizer_proc.tools import template_traits
from tokenizer_proc.validation import RequestRejected, validate_generate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

SHUTDOWN_MESSAGE = "engine is shutting down"
SHUTTING_DOWN = "shutting_down"  # RequestRejected.code of a request refused while draining


class Frontend:
    """Validates client requests, tracks them, and turns scheduler tokens into replies.

    ``seed`` seeds the generator of per-request sampling seeds, so a run with the
    same requests in the same order samples the same tokens.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, info: ModelInfo, seed: int, router: Router | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.chat_traits = template_traits(tokenizer)  # what the chat template does with tools, <think>
        self.router = router or Router()
        self.requests = RequestTable(tokenizer, on_drop=self.router.release)
        self._rng = random.Random(seed)
        self._client_codec: Codec[ClientRequest] = Codec(ClientRequest)
        # Each replica's last EngineStats (--dp-size); None until its scheduler is up.
        self.replica_stats: list[EngineStats | None] = [None] * self.router.dp_size
        self.draining = False  # set at shutdown: running requests finish, new ones are refused
        self.grammars = GrammarCompiler(tokenizer, info.vocab_size)
        # ZMQ requests whose grammar compiles, by (client, rid); True once the client aborted one.
        self._compiling: dict[tuple[bytes, str], bool] = {}

    def on_client_frames(self, frames: list[bytes]) -> Outbox:
        """A ROUTER message: [client identity, msgpack payload]. Never raises: whatever handling one
        client's message raises (a frame msgspec cannot decode, a bug in a handler) is that client's
        error reply when its rid can be read, else a logged drop; the process serves on."""
        try:
            return self._dispatch_client_frames(frames)
        except Exception as exc:
            logger.exception("handling a client message failed")
            if len(frames) != 2:
                return Outbox()
            return self.client_fault(frames[0], rid_of(frames[1]), f"internal error: {exc!r}")

    def client_fault(self, client_id: bytes, rid: str, message: str) -> Outbox:
        """An error reply for ``rid`` after a fault handling it, ending whatever of it the fault left
        behind (its table entry, a compile in flight); nothing when the rid cannot be read."""
        if not rid:
            logger.error("dropped a client message whose rid cannot be read: %s", message)
            return Outbox()
        if (client_id, rid) in self._compiling:
            self._compiling[client_id, rid] = True  # never admitted now
        try:
            out = self.requests.fail(client_id, rid, message)
        except Exception:  # the fault's own leftovers would not end; the client hears of it anyway
            logger.exception("request %r: ending it after a fault failed too", rid)
            out = Outbox()
        if not out.replies:
            out.replies.append((client_id, error_output(rid, message)))
        return out

    def _dispatch_client_frames(self, frames: list[bytes]) -> Outbox:
        if len(frames) != 2:
            logger.warning("dropping a client message of %d frames (expected 2)", len(frames))
            if len(frames) < 2:
                return Outbox()
            return Outbox(replies=[(frames[0], error_output("", "send each request as a single frame"))])
        client_id, payload = frames
        try:
            msg = self._client_codec.decode(payload)
        except msgspec.DecodeError as exc:
            logger.info("malformed request from %r: %s", client_id, exc)
            return Outbox(replies=[(client_id, error_output(rid_of(payload), f"malformed request: {exc}"))])
        match msg:
            case GenerateRequest():
                return self._on_generate(client_id, msg)
            case AbortRequest():
                if (client_id, msg.rid) in self._compiling:
                    self._compiling[client_id, msg.rid] = True
                    aborted = GenerateOutput(rid=msg.rid, finish_reason=FinishReason.ABORT)
                    return Outbox(replies=[(client_id, aborted)])
                return self.requests.abort(client_id, msg.rid)
            case FlushCacheRequest():
                done = GenerateOutput(rid=msg.rid, finish_reason=FinishReason.STOP)
                return Outbox(replies=[(client_id, done)], to_scheduler=[FlushPrefixCache()])
            case _:
                raise AssertionError(f"ClientRequest decoded to unexpected {type(msg).__name__}")

    def on_scheduler_msg(self, msg: ToTokenizer) -> Outbox:
        match msg:
            case TokenBatch():
                return self.requests.on_token_batch(msg)
            case RequestError():
                return self.requests.on_request_error(msg)
            case EngineStats():
                if 0 <= msg.replica < len(self.replica_stats):
                    self.replica_stats[msg.replica] = msg
                return Outbox()
            case _:
                raise AssertionError(f"ToTokenizer decoded to unexpected {type(msg).__name__}")

    @property
    def engine_stats(self) -> EngineStats | None:
        """Every replica's stats summed; None until every scheduler is up."""
        return total_stats(self.replica_stats)

    def destinations(self, msg: ToScheduler) -> list[int]:
        """The replicas ``msg`` goes to: a request to the one it was routed to; the rest to all
        (a FinishReq for a rid a replica does not hold is ignored there)."""
        if isinstance(msg, TokenizedRequest):
            return [self.router.replica_of(msg.rid)]
        return list(range(self.router.dp_size))

    def shutdown(self) -> Outbox:
        out = self.requests.fail_all(SHUTDOWN_MESSAGE)
        for (client_id, rid), aborted in self._compiling.items():
            if not aborted:
                self._compiling[client_id, rid] = True  # never admitted now
                out.replies.append((client_id, error_output(rid, SHUTDOWN_MESSAGE)))
        return out

    def client_gone(self, client_id: bytes) -> Outbox:
        """A client that can no longer be reached: abort its requests so their KV is freed."""
        return self.requests.abort_client(client_id)

    async def compile_grammar(self, req: GenerateRequest) -> CompiledSpec | None:
        """Check that every tool's parameters schema compiles, whatever the tool_choice, then compile
        ``req``'s grammar (off the event loop, once per distinct one); None when it has none. Raise
        RequestRejected naming the tool's parameters, or ``sampling.grammar`` (``tool_choice`` when
        the grammar is a forced call's)."""
        for i, schema in _tool_schemas(req):
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
            forced = req.sampling.grammar == tool_grammar(req)
            param = "tool_choice" if forced else "sampling.grammar"
            raise RequestRejected(param, f"cannot be compiled: {exc}") from None
        except Exception as exc:  # a compiler fault on one odd grammar must not take the engine down
            logger.exception("request %r: compiling its grammar failed", req.rid)
            raise RequestRejected("sampling.grammar", f"could not be compiled: {exc!r}") from exc

    async def admit_after_compile(self, client_id: bytes, req: GenerateRequest) -> Outbox:
        """A ZMQ request of Outbox.to_compile: compile its grammar, then admit it (unless the
        client aborted it meanwhile); a rejection is an error reply."""
        key = (client_id, req.rid)
        self._compiling.setdefault(key, False)
        try:
            grammar = await self.compile_grammar(req)
            if self._compiling[key]:
                return Outbox()  # aborted while compiling: its ABORT reply went out then
            return self.admit(client_id, req, grammar)
        except RequestRejected as exc:
            return Outbox(replies=[(client_id, error_output(req.rid, str(exc)))])
        except Exception as exc:  # a bug on one request: its error reply, not a task dying unheard
            logger.exception("request %r: admitting it after its compile failed", req.rid)
            return self.client_fault(client_id, req.rid, f"internal error: {exc!r}")
        finally:
            del self._compiling[key]

    def admit(
        self,
        client_id: bytes,
        req: GenerateRequest,
        grammar: CompiledSpec | None = None,
        *,
        clamp_to_context: bool = True,
    ) -> Outbox:
        """Validate and start ``req`` (``grammar``: its grammar compiled, when it has one;
        ``clamp_to_context``: see validate_generate); raise RequestRejected (the HTTP API maps it to
        a status)."""
        if self.draining:
            raise RequestRejected(None, SHUTDOWN_MESSAGE, SHUTTING_DOWN)
        self.requests.check_new_rid(client_id, req.rid)
        try:
            valid = validate_generate(
                req,
                self.tokenizer,
                self.info,
                self._rng,
                grammar,
                traits=self.chat_traits,
                clamp_to_context=clamp_to_context,
            )
        except RequestRejected:
            raise
        except Exception as exc:  # a tokenizer bug on one odd input must not take the engine down
            logger.exception("request %r failed in tokenization", req.rid)
            raise RequestRejected(None, f"tokenization failed: {exc!r}") from exc
        tokenized = self.requests.add(client_id, valid)
        self.router.route(tokenized.rid, tokenized.n, valid.input_ids, valid.cache_salt, valid.max_new_tokens)
        return Outbox(to_scheduler=[tokenized])

    def _on_generate(self, client_id: bytes, req: GenerateRequest) -> Outbox:
        try:  # a forced tool call's grammar is set before anything looks at the request's grammar
            req = with_tool_grammar(req)
        except RequestRejected as exc:
            return Outbox(replies=[(client_id, error_output(req.rid, str(exc)))])
        grammar = None if req.sampling.grammar is None else self.grammars.cached(req.sampling.grammar)
        tools_checked = all(self.grammars.schema_checked(schema) for _, schema in _tool_schemas(req))
        if req.sampling.grammar is not None or not tools_checked:
            if (client_id, req.rid) in self._compiling:
                return Outbox(replies=[(client_id, error_output(req.rid, f"rid {req.rid!r} is in flight"))])
            if (req.sampling.grammar is not None and grammar is None) or not tools_checked:
                self._compiling[client_id, req.rid] = False  # from now on an abort finds it
                return Outbox(to_compile=[(client_id, req)])
        try:
            return self.admit(client_id, req, grammar)
        except RequestRejected as exc:
            return Outbox(replies=[(client_id, error_output(req.rid, str(exc)))])


def _tool_schemas(req: GenerateRequest) -> list[tuple[int, str]]:
    """(index, JSON text) of each tool's parameters schema, of a chat request (what else has tools
    is refused in validation)."""
    if req.messages is None:
        return []
    return [(i, schema) for i, tool in enumerate(req.tools or []) if (schema := parameters_json(i, tool))]


def total_stats(stats: list[EngineStats | None]) -> EngineStats | None:
    """The replicas' EngineStats summed (the workers' busy seconds too; their clocks: the latest)."""
    known = [s for s in stats if s is not None]
    if len(known) != len(stats):
        return None
    if len(known) == 1:
        return known[0]
    return EngineStats(
        num_running=sum(s.num_running for s in known),
        num_waiting=sum(s.num_waiting for s in known),
        num_pages=sum(s.num_pages for s in known),
        free_pages=sum(s.free_pages for s in known),
        evictable_pages=sum(s.evictable_pages for s in known),
        worker_busy_s=sum(s.worker_busy_s for s in known),
        worker_clock_s=max(s.worker_clock_s for s in known),
        prefill_tokens=sum(s.prefill_tokens for s in known),
    )


class _RidOnly(msgspec.Struct):
    """A client message read for its rid alone: msgspec skips the other fields without decoding
    them, so a fault elsewhere in the frame does not hide the rid."""

    rid: str = ""


_RID_DECODER = msgspec.msgpack.Decoder(_RidOnly)


def rid_of(payload: bytes) -> str:
    """The "rid" of a payload that is a msgpack map with a string rid, else ""."""
    try:
        return _RID_DECODER.decode(payload).rid
    except Exception:  # any frame at all comes here: whatever it makes msgspec raise means no rid
        return ""
