"""A request's prompt logprobs (echo with logprobs), gathered as its prompt's chunks come back.

Position p's logits give the logprob of prompt token p + 1, so a prompt of n tokens has n - 1
of them, at positions 0 .. n - 2; a chunk ``[start, end)`` asks for those among its positions
and names their targets (the next tokens). Every position must be computed: such a request
bypasses the prefix cache until its prompt logprobs are all in (``KVManager.attach_prefix``);
a recompute after retraction, which comes later, asks for none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.logprobs import PromptLogprobs, TopTokens


@dataclass(eq=False)
class PromptLogprobState:
    """What has come back so far of one request's ``num_positions`` prompt logprobs."""

    num_positions: int  # len(prompt) - 1
    logprobs: list[float] = field(default_factory=list)
    top: list[TopTokens] = field(default_factory=list)
    sent: bool = False  # handed to the tokenizer (once, when complete)

    def __post_init__(self) -> None:
        assert self.num_positions >= 0, "a prompt has at least one token"

    @property
    def done(self) -> bool:
        return len(self.logprobs) == self.num_positions

    def row_len(self, start: int, extend_len: int) -> int:
        """How many of a row's positions ``[start, start + extend_len)`` ask for a prompt logprob."""
        if self.done:
            return 0
        return max(0, min(start + extend_len, self.num_positions) - start)

    def add(self, start: int, logprobs: list[float], top: list[TopTokens]) -> None:
        """A chunk's logprobs, from position ``start``; chunks come back in order."""
        assert start == len(self.logprobs), f"prompt logprobs from {start}, expected {len(self.logprobs)}"
        assert len(self.logprobs) + len(logprobs) <= self.num_positions, "more prompt logprobs than positions"
        self.logprobs += logprobs
        # A batch mixing requests with and without top-N carries empty entries for the latter.
        self.top += [t for t in top if t.token_ids]

    def take(self, rid: int) -> PromptLogprobs | None:
        """The whole result, the first time it is complete; None before and after."""
        if self.sent or not self.done:
            return None
        self.sent = True
        return PromptLogprobs(rid=rid, logprobs=self.logprobs, top=self.top)
