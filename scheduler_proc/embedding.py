"""An embedding request's pooled prompt, gathered as its prompt's rows come back.

LAST pooling asks only the row that ends the prompt for its last position's hidden state; a
prefix-cache hit may serve every position before it. MEAN asks every prompt row for the sum over
its positions, so every position must be computed: such a request bypasses the prefix cache
(as prompt logprobs do) until its sum is complete. An embedding request generates nothing
(max_new_tokens 0), so it is never retracted and its rows come back once each, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.embedding import Pooling, PromptEmbedding


@dataclass(eq=False)
class EmbeddingState:
    """What has come back so far of one request's pooled prompt of ``prompt_len`` positions."""

    pooling: Pooling
    prompt_len: int
    summed: list[float] = field(default_factory=list)  # MEAN: the sum over positions [0, covered)
    covered: int = 0  # positions pooled so far (LAST: prompt_len once the last one is in)
    sent: bool = False  # handed to the tokenizer (once, when complete)

    def __post_init__(self) -> None:
        assert self.prompt_len >= 1, "a prompt has at least one token"

    @property
    def done(self) -> bool:
        return self.covered == self.prompt_len

    def row_pool(self, start: int, extend_len: int) -> Pooling | None:
        """What a row over positions ``[start, start + extend_len)`` asks the worker for."""
        end = start + extend_len
        if self.done or end > self.prompt_len:
            return None
        if self.pooling is Pooling.MEAN:  # every prompt row (the ones before may still be out)
            return Pooling.MEAN
        return Pooling.LAST if end == self.prompt_len else None

    def add(self, start: int, extend_len: int, pooled: list[float]) -> None:
        """A row's pooled hidden states (its ``row_pool`` was not None)."""
        if self.pooling is Pooling.LAST:
            assert start + extend_len == self.prompt_len, "a LAST row must end the prompt"
            self.summed, self.covered = list(pooled), self.prompt_len
            return
        assert start == self.covered, f"MEAN rows from {start}, expected {self.covered}"
        self.summed = (
            [a + b for a, b in zip(self.summed, pooled, strict=True)] if self.summed else list(pooled)
        )
        self.covered += extend_len

    def take(self, rid: int) -> PromptEmbedding | None:
        """The pooled prompt, the first time it is complete; None before and after."""
        if self.sent or not self.done:
            return None
        self.sent = True
        scale = 1.0 / self.prompt_len if self.pooling is Pooling.MEAN else 1.0
        return PromptEmbedding(rid=rid, values=[v * scale for v in self.summed])
