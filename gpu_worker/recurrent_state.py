"""The recurrent-state pool beside the KV pool: what a hybrid model's linear-attention layers (Gated
DeltaNet, models/gated_delta.py) keep per running request instead of a growing KV cache.

Layout: per linear layer one conv state ``[slots, conv_channels, conv_kernel - 1]`` (the last inputs
of its causal conv1d, in the model's dtype) and one recurrent state ``[slots, value_heads, d_k, d_v]``
(float32 whatever the activations' dtype: it folds in every earlier token, and rounding it each
step would drift). Slot i is the state of req_pool_idx i: the scheduler owns the slots as it owns
the rows of the page table (given at admission, taken back at finish or retraction), so the worker
needs no allocator. A row whose ``prefix_len`` is 0 starts its request: its slot is zeroed before
the forward (a retracted request is re-admitted so and recomputes). A later chunk of a chunked
prefill, a decode step and an overlap-scheduled step continue from the slot as the previous batch
left it (the worker runs batches in order). A fork (n > 1) gets a copy of its parent row's slot after
the forward that ends the prompt.

Checkpoints (the prefix cache's, scheduler_proc/state_checkpoints.py) are more rows of the same
tensors, after the slots: checkpoint c is row ``slots + c``. A batch loads a checkpoint into a row's
slot before the forward (a prefix hit resumes there) and saves a row's state after some of its
tokens: after the forward where that is the whole row, else inside the linear layers, which run the
row in two pieces (``RecurrentBatch.pieces``).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from protocol.worker_messages import ForwardBatch

if TYPE_CHECKING:
    from gpu_worker.models.gated_delta_pooled import Round

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StateShape:
    """A model's recurrent state per request: ``layers`` linear layers, each a conv state
    [conv_channels, conv_kernel - 1] and a recurrent state [heads, d_k, d_v]."""

    layers: int
    conv_channels: int
    conv_kernel: int
    heads: int
    d_k: int
    d_v: int

    def bytes_per_request(self, conv_elem_bytes: int) -> int:
        """Every linear layer's conv state (in the model's dtype) and float32 recurrent state."""
        conv = self.conv_channels * (self.conv_kernel - 1) * conv_elem_bytes
        return self.layers * (conv + self.heads * self.d_k * self.d_v * 4)


class StatePool:
    """Every linear layer's conv and recurrent states of ``slots`` requests (module docstring)."""

    def __init__(
        self, shape: StateShape, slots: int, checkpoints: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.shape, self.slots, self.checkpoints = shape, slots, checkpoints
        rows = slots + checkpoints
        conv = (rows, shape.conv_channels, shape.conv_kernel - 1)
        recurrent = (rows, shape.heads, shape.d_k, shape.d_v)
        # torch.empty: a slot is zeroed when its request starts and a checkpoint written before it is
        # read, so memory the running requests do not use stays unallocated.
        self.conv = [torch.empty(conv, dtype=dtype, device=device) for _ in range(shape.layers)]
        self.recurrent = [
            torch.empty(recurrent, dtype=torch.float32, device=device) for _ in range(shape.layers)
        ]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.conv, *self.recurrent))

    def reset(self, slots: list[int]) -> None:
        """Zero the states of ``slots`` (requests starting from their first token)."""
        if not slots:
            return
        index = torch.tensor(slots, dtype=torch.int64, device=self.conv[0].device)
        for state in (*self.conv, *self.recurrent):
            state.index_fill_(0, index, 0)

    def copy(self, src: list[int], dst: list[int]) -> None:
        """Slot ``dst[i]`` becomes a copy of slot ``src[i]`` (a fork of a finished prompt)."""
        if not src:
            return
        device = self.conv[0].device
        src_index = torch.tensor(src, dtype=torch.int64, device=device)
        dst_index = torch.tensor(dst, dtype=torch.int64, device=device)
        for state in (*self.conv, *self.recurrent):
            state.index_copy_(0, dst_index, state.index_select(0, src_index))


@dataclass(frozen=True)
class RecurrentBatch:
    """One batch's rows as the linear layers see them: each row's slot and its tokens' span.

    ``decode_rows``: the rows of one token, stepped together; ``prefill_rows`` the others, each a
    sequence from its slot's state."""

    pool: StatePool
    slots: list[int]  # per row: its req_pool_idx
    starts: list[int]  # per row: its first token's index in the batch
    extend_lens: list[int]
    decode_rows: list[int]
    prefill_rows: list[int]
    inner_saves: dict[int, tuple[int, int]]  # row -> (its tokens before the save, the pool row saved to)

    @classmethod
    def of(
        cls,
        pool: StatePool,
        req_pool_idx: list[int],
        extend_lens: list[int],
        inner_saves: dict[int, tuple[int, int]] | None = None,
    ) -> RecurrentBatch:
        starts = [end - n for end, n in zip(accumulate(extend_lens), extend_lens, strict=True)]
        decode = [i for i, n in enumerate(extend_lens) if n == 1]
        prefill = [i for i, n in enumerate(extend_lens) if n > 1]
        return cls(pool, list(req_pool_idx), starts, list(extend_lens), decode, prefill, inner_saves or {})

    @functools.cached_property
    def rounds(self) -> list[Round]:
        """The rows as kernels over the pool run them (models/gated_delta_pooled.py), built once."""
        from gpu_worker.models.gated_delta_pooled import rounds

        return rounds(self)

    @property
    def steps_whole(self) -> bool:
        """Whether each row decodes one token without a checkpoint inside it (``step_slots``' case,
        without its tensor: a one-call decode passes the rows' req_pool_idx it has already)."""
        return len(self.decode_rows) == len(self.slots) and not self.inner_saves

    @functools.cached_property
    def step_slots(self) -> torch.Tensor | None:
        """Every row's slot (int64) where each row decodes one token without a checkpoint inside it,
        the rows in token order (a backend's fused decode step, models/gated_delta.py); else None."""
        if not self.steps_whole:
            return None
        return torch.tensor(self.slots, dtype=torch.int64, device=self.pool.recurrent[0].device)

    def pieces(self, row: int) -> list[tuple[int, int, int | None]]:
        """A prefill row's tokens as (first token, count, pool row to save the state to after them)."""
        start, length = self.starts[row], self.extend_lens[row]
        if row not in self.inner_saves:
            return [(start, length, None)]
        head, target = self.inner_saves[row]
        return [(start, head, target), (start + head, length - head, None)]

    def decode_slots(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([self.slots[i] for i in self.decode_rows], dtype=torch.int64, device=device)

    def decode_tokens(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([self.starts[i] for i in self.decode_rows], dtype=torch.int64, device=device)


def begin_batch(pool: StatePool, batch: ForwardBatch) -> RecurrentBatch:
    """The batch's rows for the linear layers: the slots of the rows that start a request zeroed,
    those of a prefix hit loaded from their checkpoints."""
    checkpoints = (batch.state_load_rows, batch.state_load_ids, batch.state_save_rows, batch.state_save_ids)
    if (
        not any(checkpoints)
        and not batch.state_save_lens
        and all(batch.prefix_lens)
        and not any(batch.draft_lens)
    ):
        # No checkpoint, no new request (a decode step): nothing to check, load or zero.
        return RecurrentBatch.of(pool, batch.req_pool_idx, batch.extend_lens)
    check_checkpoints(pool, batch)
    slots = batch.req_pool_idx
    pool.copy([pool.slots + c for c in batch.state_load_ids], [slots[row] for row in batch.state_load_rows])
    pool.reset([slot for slot, prefix_len in zip(slots, batch.prefix_lens, strict=True) if prefix_len == 0])
    saves = zip(batch.state_save_rows, batch.state_save_lens, batch.state_save_ids, strict=True)
    inner = {row: (n, pool.slots + c) for row, n, c in saves if n < batch.extend_lens[row]}
    return RecurrentBatch.of(pool, slots, batch.extend_lens, inner)


def end_batch(pool: StatePool, batch: ForwardBatch) -> None:
    """The checkpoints of rows saved after all their tokens; each fork's slot a copy of its parent
    row's, the state after the whole prompt."""
    if not (batch.state_save_rows or batch.state_save_lens or batch.state_save_ids or batch.fork_rows):
        return
    saves = zip(batch.state_save_rows, batch.state_save_lens, batch.state_save_ids, strict=True)
    whole = [(row, c) for row, n, c in saves if n == batch.extend_lens[row]]
    pool.copy([batch.req_pool_idx[row] for row, _ in whole], [pool.slots + c for _, c in whole])
    pool.copy([batch.req_pool_idx[row] for row in batch.fork_rows], list(batch.fork_req_pool_idx))


def check_checkpoints(pool: StatePool, batch: ForwardBatch) -> None:
    """Every checkpoint load and save names a row, a checkpoint and a token count that exist."""
    rows = len(batch.req_pool_idx)
    if any(batch.draft_lens):  # the launcher refuses speculation for these models
        raise ValueError("drafted tokens for a model with a recurrent state, which cannot roll back drafts")
    for row, c in zip(batch.state_load_rows, batch.state_load_ids, strict=True):
        if not (0 <= row < rows and 0 <= c < pool.checkpoints):
            raise ValueError(f"state checkpoint load {c} into row {row}: out of range")
    for row, n, c in zip(batch.state_save_rows, batch.state_save_lens, batch.state_save_ids, strict=True):
        if not (0 <= row < rows and 0 <= c < pool.checkpoints and 1 <= n <= batch.extend_lens[row]):
            raise ValueError(f"state checkpoint save {c} of row {row} after {n} tokens: out of range")


def auto_checkpoints(slots: int, per_request: int, kv_bytes: int) -> int:
    """As many checkpoints as a quarter of the KV pool's bytes hold, between 2 and ``slots``: they
    keep the prefix cache's hits, so they grow with the pool that holds its pages, and a long chat
    needs about one a conversation."""
    return max(2, min(slots, kv_bytes // 4 // max(per_request, 1)))


def state_pool_for(
    model: object,
    slots: int,
    checkpoints: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_bytes: int,
) -> StatePool | None:
    """A hybrid model's state pool of ``slots`` requests (--max-running-requests) and ``checkpoints``
    checkpoints (--state-checkpoints; -1: ``auto_checkpoints``), its budget logged; None for a model
    whose layers are all attention."""
    shape: StateShape | None = getattr(model, "state_shape", None)
    if shape is None:
        return None
    per_request = shape.bytes_per_request(torch.empty((), dtype=dtype).element_size())
    checkpoints = auto_checkpoints(slots, per_request, kv_bytes) if checkpoints < 0 else checkpoints
    pool = StatePool(shape, slots, checkpoints, dtype, device)
    logger.info(
        "recurrent-state pool: %d linear layers, %d bytes a request or checkpoint (conv %s, recurrent "
        "float32); %d requests (--max-running-requests) + %d checkpoints (--state-checkpoints): "
        "%.1f MiB at most, touched as they are used",
        shape.layers, per_request, str(dtype).removeprefix("torch."), slots, checkpoints,
        pool.nbytes / 2**20,
    )  # fmt: skip
    return pool
