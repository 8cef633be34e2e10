"""The logprob payloads that messages.py's messages carry: top-N alternatives and prompt logprobs."""

from __future__ import annotations

import msgspec

MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for at each position (OpenAI's cap)


class TopLogprobs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The most likely tokens at one position, most likely first, with their logprobs (to clients)."""

    token_ids: list[int]
    logprobs: list[float]


class TopTokens(msgspec.Struct, frozen=True, array_like=True):
    """TopLogprobs between our own processes (a msgpack array)."""

    token_ids: list[int]
    logprobs: list[float]


class PromptLogprobs(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Request ``rid``'s prompt tokens 1..n-1: each one's logprob, and its top-N when it asked."""

    rid: int
    logprobs: list[float]
    top: list[TopTokens]  # empty when the request asked for no top-N
