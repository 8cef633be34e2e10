"""Embedding requests (``GenerateRequest.embed``): how a prompt's final hidden states are pooled,
and the pooled vector on its way back (messages.py's messages carry these).

The worker pools the final-norm hidden states of the rows it is told to (``ForwardBatch.pool``):
LAST gives the row's last position, MEAN the sum over the row's positions; the scheduler adds a
prompt's chunks up and divides (a MEAN request computes every prompt position, bypassing the
prefix cache; a LAST one may have its prefix served from the cache). The tokenizer normalizes.
"""

from __future__ import annotations

import enum

import msgspec


class Pooling(enum.Enum):
    """How a prompt's final hidden states become one vector (the model's config says which)."""

    LAST = "last"  # the prompt's last position (decoder LMs' default)
    MEAN = "mean"  # the mean over every prompt position


class PromptEmbedding(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Request ``rid``'s pooled prompt (not normalized), scheduler -> tokenizer."""

    rid: int
    values: list[float]
