"""The greedy draw inside the LM head: each row's argmax of its logits, computed as the head's kernel
computes them, without the logits.

A batch whose draw is the argmax alone (draws.py's ``argmax_alone``: every row greedy, no penalties,
grammar, logprobs, top-N, forks or drafts) needs no logits, only their argmax. At 32 rows the logits
of a 262144-token vocabulary are 33.5 MB, written by the head, read back by a final soft-cap (Gemma
4) and again by the argmax; a head kernel that folds each panel of them into each row's running
(max, first index) while the panel is in the caches (csrc/quant.c's quant_matmul_argmax) reads the
weights alone. The result is the argmax of the logits the head would have returned, soft-capped by
the same float operations (softcap_f32's), first index on ties: the same tokens, bit for bit.

A model offers it by ``compute_argmax`` (``GreedyHead``), which returns None where its head has no
such kernel (``ArgmaxLinear``): then the runner computes the logits as before. A tensor-parallel
head (its impl the gather of every rank's logits) has none, so it keeps the logits path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

import torch

if TYPE_CHECKING:
    from gpu_worker.models.layers import Linear


@runtime_checkable
class ArgmaxLinear(Protocol):
    """A Linear impl that computes the argmax of its output without the output (cpu/quant.py's
    QuantLinear)."""

    def argmax_fits(self, rows: int, dtype: torch.dtype, cap: float) -> bool: ...

    def argmax(self, x: torch.Tensor, cap: float) -> torch.Tensor: ...


@runtime_checkable
class GreedyHead(Protocol):
    """A model whose greedy draw its head can compute without the logits."""

    head_softcap: float  # the final soft-cap its logits take (0: none): a capped head's argmax is tanh's

    def compute_argmax(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """int64 [N]: the first index of the largest of each row of ``compute_logits(hidden)``, or
        None where the head has no such kernel (the caller then computes the logits)."""
        ...


def head_argmax(
    head: Linear, norm: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, cap: float = 0.0
) -> torch.Tensor | None:
    """The argmax of ``head(norm(hidden))`` soft-capped by softcap_f32's operations (``cap`` > 0),
    from the head's kernel, or None (before the norm runs) where it has none for these rows."""
    # The impl's own method looked up, not isinstance(impl, ArgmaxLinear): a runtime protocol's check
    # walks its members a call, several times this function's other work on a one-row step.
    fits = getattr(head.impl, "argmax_fits", None)
    if fits is None or not fits(hidden.shape[0], hidden.dtype, cap):
        return None
    return cast("ArgmaxLinear", head.impl).argmax(norm(hidden), cap)
