"""What the scheduler owes the tokenizer after a step: one TokenBatch plus any errors."""

from __future__ import annotations

from protocol.messages import FinishReason, RequestError, TokenBatch, ToTokenizer


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

    def add_token(
        self, rid: int, token_id: int, logprob: float, finished: FinishReason | None, cached_tokens: int = 0
    ) -> None:
        self._rids.append(rid)
        self._token_ids.append(token_id)
        self._logprobs.append(logprob)
        self._finished.append(finished)
        self._cached.append(cached_tokens)

    def add_abort(self, rid: int, reason: FinishReason, cached_tokens: int = 0) -> None:
        """An ended request with no new token: token id -1 by the TokenBatch contract."""
        self.add_token(rid, -1, 0.0, reason, cached_tokens)

    def add_error(self, rid: int, message: str) -> None:
        self._errors.append(RequestError(rid=rid, message=message))

    def take(self) -> list[ToTokenizer]:
        out: list[ToTokenizer] = []
        if self._rids:
            out.append(
                TokenBatch(
                    rids=self._rids,
                    token_ids=self._token_ids,
                    logprobs=self._logprobs,
                    finished=self._finished,
                    cached_tokens=self._cached,
                )
            )
            self._reset_rows()
        out.extend(self._errors)
        self._errors = []
        return out
