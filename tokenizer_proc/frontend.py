"""The tokenizer process's logic without its sockets: frames in, an Outbox of messages out."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
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
from tokenizer_proc.intake import SHUTDOWN_MESSAGE, Admitting, Intake
from tokenizer_proc.model_info import ModelInfo
from tokenizer_proc.outbox import Outbox, error_output
from tokenizer_proc.request_table import RequestTable
from tokenizer_proc.router import Router
from tokenizer_proc.validation import RequestRejected

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class Frontend:
    """Takes client frames in, tracks requests, and turns scheduler tokens into replies.

    Requests from both front doors get in through ``intake`` (intake.py); ``clock`` times
    them for the serving metrics.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        info: ModelInfo,
        seed: int,
        router: Router | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tokenizer = tokenizer
        self.router = router or Router()
        self.requests = RequestTable(tokenizer, clock, on_drop=self.router.release)
        self.intake = Intake(tokenizer, info, seed, self.requests, self.router)
        self.grammars = self.intake.grammars
        self._client_codec: Codec[ClientRequest] = Codec(ClientRequest)
        # Each replica's last EngineStats (--dp-size); None until its scheduler is up.
        self.replica_stats: list[EngineStats | None] = [None] * self.router.dp_size
        # ZMQ requests whose grammar compiles, by (client, rid): an abort finds them here.
        self._compiling: dict[tuple[bytes, str], Admitting] = {}

    @property
    def info(self) -> ModelInfo:
        """The limits requests are validated against (the intake's: see ``_serve_context``)."""
        return self.intake.info

    @property
    def draining(self) -> bool:
        """Set at shutdown: running requests finish, new ones are refused."""
        return self.intake.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.intake.draining = value

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
        if (pending := self._compiling.get((client_id, rid))) is not None:
            pending.ended = True  # never admitted now
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
                if (pending := self._compiling.get((client_id, msg.rid))) is not None:
                    pending.ended = True
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
                    self._serve_context(msg.context_len)
                return Outbox()
            case _:
                raise AssertionError(f"ToTokenizer decoded to unexpected {type(msg).__name__}")

    def _serve_context(self, served: int) -> None:
        """Validate against the context a replica serves where it is shorter than the model's (its
        KV pool holds fewer tokens): a request without a limit is clamped to what can run, not sent
        to be refused."""
        if 1 < served < self.info.context_len:
            self.intake.info = replace(self.intake.info, context_len=served)

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
        for (client_id, rid), pending in self._compiling.items():
            if not pending.ended:
                pending.ended = True  # never admitted now
                out.replies.append((client_id, error_output(rid, SHUTDOWN_MESSAGE)))
        return out

    def client_gone(self, client_id: bytes) -> Outbox:
        """A client that can no longer be reached: abort its requests so their KV is freed."""
        return self.requests.abort_client(client_id)

    async def admit(self, client_id: bytes, req: GenerateRequest, *, clamp_to_context: bool = True) -> Outbox:
        """Admit an HTTP request (each is a client of its own, so no abort reaches it while it
        compiles): the whole admission, waiting for its compile; raise RequestRejected (the HTTP
        API maps it to a status). ``clamp_to_context``: see validate_generate."""
        pending = self.intake.begin(client_id, req, clamp_to_context=clamp_to_context)
        tokenized = await self.intake.admit(pending)
        assert tokenized is not None, "only an abort or shutdown ends a request while it compiles"
        return Outbox(to_scheduler=[tokenized])

    async def admit_after_compile(self, pending: Admitting) -> Outbox:
        """A ZMQ request of Outbox.to_compile: compile, then start it (unless the client aborted it
        meanwhile); a rejection is an error reply."""
        client_id, rid = pending.key
        self._compiling.setdefault(pending.key, pending)
        try:
            tokenized = await self.intake.admit(pending)
            return Outbox(to_scheduler=[tokenized] if tokenized is not None else [])
        except RequestRejected as exc:
            return Outbox(replies=[(client_id, error_output(rid, str(exc)))])
        except Exception as exc:  # a bug on one request: its error reply, not a task dying unheard
            logger.exception("request %r: admitting it after its compile failed", rid)
            return self.client_fault(client_id, rid, f"internal error: {exc!r}")
        finally:
            del self._compiling[pending.key]

    def _on_generate(self, client_id: bytes, req: GenerateRequest) -> Outbox:
        """A ZMQ request: started now when nothing is left to compile, else handed to the process
        to compile off its loop (Outbox.to_compile, then admit_after_compile)."""
        try:
            pending = self.intake.begin(client_id, req)
            if pending.key in self._compiling:
                return Outbox(replies=[(client_id, error_output(req.rid, f"rid {req.rid!r} is in flight"))])
            if not pending.compiled:
                self._compiling[pending.key] = pending  # from now on an abort finds it
                return Outbox(to_compile=[pending])
            return Outbox(to_scheduler=[self.intake.start(pending)])
        except RequestRejected as exc:
            return Outbox(replies=[(client_id, error_output(req.rid, str(exc)))])


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
        draft_tokens=sum(s.draft_tokens for s in known),
        accepted_draft_tokens=sum(s.accepted_draft_tokens for s in known),
        verify_rows=sum(s.verify_rows for s in known),
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
