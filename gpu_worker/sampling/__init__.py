"""What turns logits into tokens, per request: sampler settings, penalties, grammars, logprobs.

Each keeps per-request state, indexed by req_pool_idx, that the runner updates from every batch
through one protocol, ``ReqPoolState``, before the forward; the sampling step then reads them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from protocol.messages import ForwardBatch


class ReqPoolState(Protocol):
    """Per-request sampling state the runner keeps in step with the scheduler's batches."""

    def on_batch(self, batch: ForwardBatch, input_ids: torch.Tensor) -> None:
        """Take the batch's new requests' settings, its tokens (PENDING resolved in ``input_ids``)
        and its forks (n > 1: a fork starts from its parent's prompt state). A verify row's
        drafts are not among its tokens here (verify.py's ``committed``)."""
        ...

    def on_drafts_taken(self, req_pool_idx: list[int], positions: list[int], tokens: list[int]) -> None:
        """Drafted ``tokens`` a verify row kept, at ``positions`` of ``req_pool_idx`` (one per request, in
        position order across calls): inputs now, as if a batch had run them."""
        ...
