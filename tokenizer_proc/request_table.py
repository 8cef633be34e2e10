"""Per-request bookkeeping of the tokenizer process: from scheduler rows to client replies.

No sockets here: every method takes messages and returns what to send, so the
whole request life cycle is unit-testable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from protocol.logprobs import TopTokens
from protocol.messages import (
    FinishReason,
    FinishReq,
    RequestError,
    TokenBatch,
    TokenizedRequest,
)
from tokenizer_proc.chat.reply_parser import reply_parser
from tokenizer_proc.detokenizer import IncrementalDetokenizer, TokenDecoder
from tokenizer_proc.echo import EchoPrompt
from tokenizer_proc.metrics import ServingMetrics
from tokenizer_proc.outbox import Outbox, error_output
from tokenizer_proc.pooling import normalized
from tokenizer_proc.request_state import RequestState
from tokenizer_proc.stop import StopMatcher
from tokenizer_proc.validation import RequestRejected, ValidRequest

logger = logging.getLogger(__name__)


class RequestTable:
    """All in-flight requests, keyed by the internal rid the scheduler knows them by; a request
    with n choices is n of them, rids rid .. rid + n - 1 under one client rid."""

    def __init__(
        self,
        tokenizer: TokenDecoder,
        clock: Callable[[], float] = time.monotonic,
        on_drop: Callable[[int], None] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._clock = clock
        self._on_drop = on_drop  # told every rid that leaves the table (the router's load)
        self.metrics = ServingMetrics()
        self._next_rid = 0
        self._states: dict[int, RequestState] = {}
        self._by_client: dict[tuple[bytes, str], list[int]] = {}  # -> the rids of its choices

    def __len__(self) -> int:
        return len(self._states)

    def check_new_rid(self, client_id: bytes, client_rid: str) -> None:
        if (client_id, client_rid) in self._by_client:
            raise RequestRejected("rid", f"{client_rid!r} is already in flight on this connection")

    def add(self, client_id: bytes, valid: ValidRequest) -> TokenizedRequest:
        """Start tracking an accepted request; return what to send to the scheduler."""
        self.check_new_rid(client_id, valid.client_rid)
        rid = self._next_rid
        self._next_rid += valid.n
        for index in range(valid.n):
            self._states[rid + index] = RequestState(
                rid=rid + index,
                client_id=client_id,
                client_rid=valid.client_rid,
                prompt_tokens=len(valid.input_ids),
                stream=valid.stream,
                want_logprobs=valid.logprobs,
                detokenizer=IncrementalDetokenizer(self._tokenizer),
                stop=StopMatcher(valid.stop),
                incremental=valid.stream or bool(valid.stop),
                arrival_s=self._clock(),
                want_top=valid.top_logprobs > 0,
                echo=EchoPrompt(valid.input_ids, valid.echo_text) if valid.echo_text is not None else None,
                index=index,
                num_choices=valid.n,
                chat=reply_parser(valid.chat_output, self._tokenizer),
            )
        self._by_client[(client_id, valid.client_rid)] = list(range(rid, rid + valid.n))
        self.metrics.prompt_tokens += len(valid.input_ids)
        return TokenizedRequest(
            rid=rid,
            input_ids=valid.input_ids,
            max_new_tokens=valid.max_new_tokens,
            stop_token_ids=valid.stop_token_ids,
            sampler=valid.sampler,
            cache_salt=valid.cache_salt,
            prompt_logprobs=valid.prompt_logprobs,
            n=valid.n,
            pooling=valid.pooling,
            images=valid.images,
        )

    def abort(self, client_id: bytes, client_rid: str) -> Outbox:
        """A client abort: answer ABORT at once and tell the scheduler; later rows are ignored."""
        rids = self._by_client.get((client_id, client_rid))
        if rids is None:
            message = f"abort: no request {client_rid!r} in flight"
            return Outbox(replies=[(client_id, error_output(client_rid, message))])
        out = Outbox()
        for rid in list(rids):  # every choice still running
            state = self._drop(rid, FinishReason.ABORT)
            out.replies.append((client_id, state.final_output("", [], FinishReason.ABORT)))
            out.to_scheduler.append(FinishReq(rid=rid, reason=FinishReason.ABORT))
        return out

    def fail(self, client_id: bytes, client_rid: str, message: str) -> Outbox:
        """End a request with an error reply per choice (after a fault handling it) and stop it in
        the scheduler; nothing when it is not in flight."""
        out = Outbox()
        for rid in list(self._by_client.get((client_id, client_rid), [])):
            self._fail(self._states[rid], message, out)
        return out

    def abort_client(self, client_id: bytes) -> Outbox:
        """The client went away: abort all of its requests (the replies go nowhere, but are made)."""
        out = Outbox()
        for key in [key for key in self._by_client if key[0] == client_id]:
            aborted = self.abort(*key)
            out.replies += aborted.replies
            out.to_scheduler += aborted.to_scheduler
        return out

    def client_ids(self) -> set[bytes]:
        """Every client with a request in flight."""
        return {client_id for client_id, _ in self._by_client}

    def on_token_batch(self, batch: TokenBatch) -> Outbox:
        """One engine step's rows; only the rows' own requests are touched."""
        out = Outbox()
        for lp in batch.prompt_logprobs:  # before the rows: a request's first reply carries them
            leader = self._states.get(lp.rid)  # choice 0: its prompt is every choice's
            for rid in range(lp.rid, lp.rid + (leader.num_choices if leader is not None else 0)):
                state = self._states.get(rid)
                if state is not None and state.echo is not None:
                    state.echo.take(lp)
        for pooled in batch.embeddings:  # before the rows: the row that ends the request follows
            if (state := self._states.get(pooled.rid)) is not None:
                state.embedding = normalized(pooled.values)
        for i, rid in enumerate(batch.rids):
            state = self._states.get(rid)
            if state is None:
                continue  # aborted or stopped already; the scheduler had not heard yet
            state.cached_tokens = max(state.cached_tokens, batch.cached_tokens[i])
            if state.want_top and batch.token_ids[i] >= 0:
                state.top.append(batch.top_logprobs[i] if batch.top_logprobs else TopTokens([], []))
            try:
                self._on_row(state, batch.token_ids[i], batch.logprobs[i], batch.finished[i], out)
            except Exception as exc:  # a fault on one request's row (its text, its parser) ends it alone
                logger.exception("request %r: handling its tokens failed", state.client_rid)
                self._fail(state, f"internal error: {exc!r}", out)
        return out

    def on_request_error(self, err: RequestError) -> Outbox:
        if err.rid not in self._states:
            return Outbox()
        state = self._drop(err.rid, FinishReason.ERROR)
        return Outbox(replies=[(state.client_id, error_output(state.client_rid, err.message, state.index))])

    def fail_all(self, message: str) -> Outbox:
        """Error replies for every in-flight request (shutdown)."""
        out = Outbox()
        for rid in list(self._states):
            state = self._drop(rid, FinishReason.ERROR)
            out.replies.append((state.client_id, error_output(state.client_rid, message, state.index)))
        return out

    def _on_row(
        self, state: RequestState, token_id: int, logprob: float, finished: FinishReason | None, out: Outbox
    ) -> None:
        new_ids = [token_id] if token_id >= 0 else []
        state.logprobs.extend([logprob] * len(new_ids))
        if new_ids:
            self._on_token_timing(state)
        if finished is None and not new_ids:
            return  # nothing new (the protocol sends -1 only with finished set)
        delta = state.advance(new_ids, final=finished is not None)
        if state.stop.matched is not None:
            if finished is None:  # the scheduler still runs it: stop it there too
                out.to_scheduler.append(FinishReq(rid=state.rid, reason=FinishReason.STOP))
            finished = FinishReason.STOP
        if finished is None:
            if state.stream:
                out.replies.append((state.client_id, state.stream_output(delta, new_ids)))
            return
        self._drop(state.rid, finished)
        out.replies.append((state.client_id, state.final_output(delta, new_ids, finished)))

    def _fail(self, state: RequestState, message: str, out: Outbox) -> None:
        """``state``'s error reply; the scheduler stops it if it still runs (a FinishReq for a rid it
        has finished is ignored). A row that failed after its request was dropped is only replied to."""
        if state.rid in self._states:
            self._drop(state.rid, FinishReason.ERROR)
            out.to_scheduler.append(FinishReq(rid=state.rid, reason=FinishReason.ABORT))
        out.replies.append((state.client_id, error_output(state.client_rid, message, state.index)))

    def _on_token_timing(self, state: RequestState) -> None:
        now = self._clock()
        if state.last_token_s is None:
            self.metrics.ttft_s.observe(now - state.arrival_s)
        else:
            self.metrics.itl_s.observe(now - state.last_token_s)
        state.last_token_s = now
        self.metrics.generation_tokens += 1

    def _drop(self, rid: int, reason: FinishReason) -> RequestState:
        state = self._states.pop(rid)
        if self._on_drop is not None:
            self._on_drop(rid)
        key = (state.client_id, state.client_rid)
        self._by_client[key].remove(rid)
        if not self._by_client[key]:
            del self._by_client[key]
        once = state.index == 0  # the choices share one prompt: its tokens count once
        prompt, cached = (state.prompt_tokens, state.cached_tokens) if once else (0, 0)
        self.metrics.on_finish(reason, prompt, cached, self._clock() - state.arrival_s)
        return state
