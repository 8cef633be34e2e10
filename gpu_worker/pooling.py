"""Embedding rows of a batch (``ForwardBatch.pool``): their final-norm hidden states, pooled.

The runner's hidden states are taken before the final norm (the head applies it), so the rows
that pool get it here: LAST gives the norm of the row's last position, MEAN the sum of the norms
of its positions (the scheduler adds a prompt's chunks up and divides). One norm call covers
every pooled position of the batch; sums are taken in float64. A batch with no pooling row costs
nothing.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from itertools import accumulate
from typing import Any

import torch

from protocol.embedding import Pooling
from protocol.messages import ForwardBatch

# Where our model modules keep their final norm: Llama, Mistral, Qwen, Gemma, Phi-3; GPT-2.
# (A ``final_norm`` on every model would say it directly; the model files are being reorganized.)
_FINAL_NORM_PATHS = ("model.norm", "transformer.ln_f")


def final_norm(model: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model's final norm (what its head applies before the vocabulary projection)."""
    for path in _FINAL_NORM_PATHS:
        try:
            norm: Callable[[torch.Tensor], torch.Tensor] = operator.attrgetter(path)(model)
        except AttributeError:
            continue
        return norm
    raise NotImplementedError(f"{type(model).__name__}: no final norm at {_FINAL_NORM_PATHS}")


def why_no_pooling(model: Any) -> str | None:
    """Why ``model`` cannot pool its hidden states (no final norm to apply); None when it can."""
    try:
        final_norm(model)
    except NotImplementedError as exc:
        return str(exc)
    return None


def pooled_rows(
    hidden: torch.Tensor, batch: ForwardBatch, norm: Callable[[torch.Tensor], torch.Tensor]
) -> list[list[float]]:
    """Per row with ``pool`` set, in row order: its pooled final-norm hidden state ([] for none).
    The pool rules were checked with the batch's others, before its forward (batch_checks.py)."""
    if not batch.pool:
        return []
    ends = list(accumulate(batch.extend_lens))
    spans = [
        (ends[i] - 1 if kind is Pooling.LAST else ends[i] - batch.extend_lens[i], ends[i])
        for i, kind in enumerate(batch.pool)
        if kind is not None
    ]
    if not spans:
        return []
    index = torch.cat([torch.arange(start, end) for start, end in spans]).to(hidden.device)
    normed = norm(hidden.index_select(0, index)).to(torch.float64)
    sizes = [end - start for start, end in spans]
    return [part.sum(0).tolist() for part in torch.split(normed, sizes)]
