"""What the scheduler owes the tokenizer after a step: one TokenBatch plus any errors."""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol.embedding import PromptEmbedding
from protocol.logprobs import PromptLogprobs, TopTokens
from protocol.messages import FinishReason, RequestError, TokenBatch, ToTokenizer

if TYPE_CHECKING:
    from scheduler_proc.batch import RowResult
    from scheduler_proc.prompt_logprobs import PromptLogprobState

NO_TOP = TopTokens([], [])


class OutputCollector:
    """Accumulates one step's rows so they leave as ONE TokenBatch, never a message per token."""

    def __init__(self) -> None:
        self._reset_rows()
        self._errors: list[RequestError] = []

    def _reset_rows(self) -> None:
        self._rids: list[int] = []
        self._token_ids: list[int] = []
        self._logprobs: list[float] = []
        self._finished: list[FinishReason | None] = []
        self._cached: list[int] = []
        self._top: list[TopTokens | None] = []
        self._prompt_logprobs: list[PromptLogprobs] = []
        self._embeddings: list[PromptEmbedding] = []

    def add_token(
        self,
        rid: int,
        token_id: int,
        logprob: float,
        finished: FinishReason | None,
        cached_tokens: int = 0,
        top: TopTokens | None = None,
    ) -> None:
        self._top.append(top)
        self._rids.append(rid)
        self._token_ids.append(token_id)
        self._logprobs.append(logprob)
        self._finished.append(finished)
        self._cached.append(cached_tokens)

    def add_abort(self, rid: int, reason: FinishReason, cached_tokens: int = 0) -> None:
        """An ended request with no new token: token id -1 by the TokenBatch contract."""
        self.add_token(rid, -1, 0.0, reason, cached_tokens)

    def add_prompt_logprobs(self, rid: int, state: PromptLogprobState, start: int, result: RowResult) -> None:
        """A row's prompt logprobs (from position ``start``) into ``state``; the whole prompt's
        leave with this step once complete."""
        if result.prompt_logprobs:
            state.add(start, result.prompt_logprobs, result.prompt_top)
        complete = state.take(rid)
        if complete is not None:
            self._prompt_logprobs.append(complete)

    def add_embedding(self, embedding: PromptEmbedding) -> None:
        """An embedding request's pooled prompt; it leaves before the request's last row."""
        self._embeddings.append(embedding)

    def add_error(self, rid: int, message: str) -> None:
        self._errors.append(RequestError(rid=rid, message=message))

    def take(self) -> list[ToTokenizer]:
        out: list[ToTokenizer] = []
        if self._rids or self._prompt_logprobs or self._embeddings:
            wants_top = any(t is not None and t.token_ids for t in self._top)
            out.append(
                TokenBatch(
                    rids=self._rids,
                    token_ids=self._token_ids,
                    logprobs=self._logprobs,
                    finished=self._finished,
                    cached_tokens=self._cached,
                    top_logprobs=[t or NO_TOP for t in self._top] if wants_top else [],
                    prompt_logprobs=self._prompt_logprobs,
                    embeddings=self._embeddings,
                )
            )
            self._reset_rows()
        out.extend(self._errors)
        self._errors = []
        return out
