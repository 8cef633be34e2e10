"""A Gated DeltaNet layer's conv1d and gated delta rule run by a backend's kernels over the state pool
itself (the ``pooled_rule`` kernel slot): each row's state is read and written in place at its slot,
where the ``recurrent_rule`` / ``chunked_rule`` slots take gathered copies (a decode step of 32 rows of
a Qwen3.5-4B layer gathers and scatters 64 MiB of states through them).

A row with a checkpoint inside it (recurrent_state.py) runs in two pieces: every row's first piece in
one round, the checkpoints copied, then the second pieces in another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from gpu_worker.recurrent_state import RecurrentBatch


class PooledRule(Protocol):
    """A backend's kernels over the state pool (backends/cpu/gated_delta.py's ``GatedDeltaKernels``):
    q, k [N, H_k, d_k], v [N, H_v, d_v], g and beta [N, H_v], ``state`` [S, H_v, d_k, d_v] float32,
    ``slots`` int64 [rows], ``cu_seqlens`` int64 [rows + 1] (each row's tokens); q and k L2-normed and
    q scaled in the kernel; ``state[slots]`` advanced in place; outputs in the activations' dtype.
    Value head h reads key head h // (H_v / H_k); where ``tiled_heads``, ``tiled=True`` makes it read
    key head h % H_k (a tiled checkpoint's heads without repeating q and k onto the value heads)."""

    tiled_heads: bool

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, slots: torch.Tensor, *,
               tiled: bool = False) -> torch.Tensor: ...  # fmt: skip

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor, *,
                tiled: bool = False) -> torch.Tensor: ...  # fmt: skip


class PooledConv(Protocol):
    """A backend's causal conv1d and SiLU over the conv-state pool: x [N, C], weight [C, K],
    ``conv_state`` [S, C, K - 1] advanced in place at ``slots`` (each row's tokens by ``cu_seqlens``)."""

    def conv1d(self, x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
               cu_seqlens: torch.Tensor) -> torch.Tensor: ...  # fmt: skip


class DecodeStep(Protocol):
    """A backend's whole block between the projections for a step whose rows all decode one token,
    float32 (backends/cpu/gated_delta.py's ``decode_step``): conv1d and SiLU, the L2 norms, gates and
    rule, the gated RMSNorm; both pools advanced at ``slots`` in place -> [rows, H_v d_v]."""

    def decode_step(self, parts: tuple[torch.Tensor, ...], params: tuple[torch.Tensor, ...],
                    pools: tuple[torch.Tensor, ...], slots: torch.Tensor, eps: float, k_heads: int,
                    tiled: bool) -> torch.Tensor: ...  # fmt: skip


@dataclass(frozen=True)
class Round:
    """Pieces of rows run together: their tokens' indices, slots, lengths and checkpoint rows."""

    tokens: torch.Tensor  # int64 [tokens of the round], in row order, on the pool's device
    whole: bool  # the round is every token of the batch in order (tokens is 0, 1, ...): no gather
    slots: torch.Tensor  # int64 [pieces]
    cu_seqlens: torch.Tensor  # int64 [pieces + 1]: each piece's tokens among the round's
    lengths: list[int]
    saves: list[tuple[int, int]]  # (slot, pool row to copy it to) after the round


def rounds(batch: RecurrentBatch) -> list[Round]:
    """Every row's first piece, then the second pieces of rows with a checkpoint inside them."""
    firsts: list[tuple[int, int, int, int | None]] = []  # (slot, first token, tokens, save to)
    seconds: list[tuple[int, int, int, int | None]] = []
    for row, slot in enumerate(batch.slots):
        pieces = (
            batch.pieces(row)
            if row in batch.inner_saves
            else [(batch.starts[row], batch.extend_lens[row], None)]
        )
        firsts.append((slot, *pieces[0]))
        seconds.extend((slot, *piece) for piece in pieces[1:])
    out = []
    device = batch.pool.recurrent[0].device
    total = sum(batch.extend_lens)
    for part in (firsts, seconds):
        if part:
            index = [t for _, start, n, _ in part for t in range(start, start + n)]
            whole = len(index) == total and all(t == i for i, t in enumerate(index))
            lengths = [n for _, _, n, _ in part]
            ends = [sum(lengths[: i + 1]) for i in range(len(lengths))]
            saves = [(slot, target) for slot, _, _, target in part if target is not None]
            as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
            slots = as_tensor([p[0] for p in part])
            out.append(Round(as_tensor(index), whole, slots, as_tensor([0, *ends]), lengths, saves))
    return out


def pooled_conv(kernels: PooledConv, mixed: torch.Tensor, weight: torch.Tensor, states: torch.Tensor,
                batch_rounds: list[Round]) -> torch.Tensor:  # fmt: skip
    """The causal conv1d and SiLU of every row, ``states`` (the layer's conv states) advanced."""
    weight2d = weight.view(weight.shape[0], weight.shape[-1])
    if len(batch_rounds) == 1 and batch_rounds[0].whole:  # the kernel reads the rows where they lie
        r = batch_rounds[0]
        got = kernels.conv1d(mixed, weight2d, states, r.slots, r.cu_seqlens)
        _save(states, r)
        return got
    out = torch.empty_like(mixed)
    for r in batch_rounds:
        got = kernels.conv1d(mixed.index_select(0, r.tokens), weight2d, states, r.slots, r.cu_seqlens)
        out.index_copy_(0, r.tokens, got)
        _save(states, r)
    return out


def pooled_delta_rule(kernels: PooledRule, qkvgb: tuple[torch.Tensor, ...], states: torch.Tensor,
                      batch_rounds: list[Round], tiled: bool = False) -> torch.Tensor:  # fmt: skip
    """[T, H_v, d_v]: every row's outputs of the gated delta rule, ``states`` advanced in place.
    ``tiled``: q and k hold the key heads alone, value head h reading key head h % H_k (only for
    kernels whose ``tiled_heads`` is true)."""
    if len(batch_rounds) == 1 and batch_rounds[0].whole:  # the kernels read the rows where they lie
        got = _rule_round(kernels, qkvgb, states, batch_rounds[0], tiled)
        _save(states, batch_rounds[0])
        return got
    q, v = qkvgb[0], qkvgb[2]
    out = q.new_empty((q.shape[0], v.shape[1], v.shape[2]))
    for r in batch_rounds:
        gathered = tuple(t.index_select(0, r.tokens) for t in qkvgb)
        out.index_copy_(0, r.tokens, _rule_round(kernels, gathered, states, r, tiled))
        _save(states, r)
    return out


def _rule_round(
    kernels: PooledRule, qkvgb: tuple[torch.Tensor, ...], states: torch.Tensor, r: Round, tiled: bool
) -> torch.Tensor:
    """One round's tokens (``qkvgb`` holds those alone, in the round's order) through the rule."""
    q, k, v, g, beta = qkvgb
    if max(r.lengths) == 1:  # every piece one token: the decode step
        return kernels.decode(q, k, v, g, beta, states, r.slots, tiled=tiled)
    return kernels.prefill(q, k, v, g, beta, states, r.slots, r.cu_seqlens, tiled=tiled)


def _save(states: torch.Tensor, r: Round) -> None:
    """The checkpoints taken after the round (pool rows copied from the rows' slots)."""
    for slot, target in r.saves:
        states[target] = states[slot]
