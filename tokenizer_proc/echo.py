"""Logprob payloads of client replies: top-N alternatives, and the echoed prompt (echo)."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.logprobs import PromptLogprobs, TopLogprobs, TopTokens


def to_client(top: TopTokens) -> TopLogprobs:
    return TopLogprobs(token_ids=top.token_ids, logprobs=top.logprobs)


@dataclass
class EchoPrompt:
    """The prompt a reply gives back (echo); with logprobs, theirs once the scheduler sends them.

    The first prompt token has no logprob (nothing predicts it): None, as in OpenAI's replies.
    """

    token_ids: list[int]
    text: str
    logprobs: list[float | None] | None = None
    top: list[TopLogprobs | None] | None = None
    sent: bool = False  # it goes out once: with a stream's first reply, or the whole reply

    def take(self, lp: PromptLogprobs) -> None:
        assert len(lp.logprobs) == len(self.token_ids) - 1, "one prompt logprob per token after the first"
        self.logprobs = [None, *lp.logprobs]
        self.top = [None, *(to_client(t) for t in lp.top)] if lp.top else None
