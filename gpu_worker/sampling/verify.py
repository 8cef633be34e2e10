"""Speculative decoding's worker half: where a batch draws, and which drafts a verify row keeps.

A verify row (``ForwardBatch.draft_lens[i] = d > 0``) ends with d drafted tokens after its
request's last token. It draws at each of its last d + 1 positions exactly as a decode row at that
position would: the same logits (the drafts before it are its inputs), the same penalties (counting
the drafts before it), the same grammar mask (the matcher having taken them), and, for a sampled
row, the same Gumbel noise (sampler.py: a pure function of seed, position and token). It keeps its
drafts up to the first that differs from its draw there, and that draw.

Greedy, this is token for token what decoding without drafts gives. Sampled, it is rejection
sampling with a deterministic proposal, coupled through the noise: draft d is kept exactly when
the draw from p (the fully processed distribution) is d, which happens with probability p(d); a
rejected draft's replacement is that draw, distributed as p with d removed and renormalized; and
when every draft is kept the last position's draw is the bonus token. So a seeded request draws
the same tokens with speculation as without it.

A drafted token is not an input yet for the per-request states (penalty counts, grammar matchers):
``committed`` hides the drafts from ``ReqPoolState.on_batch``, and the runner hands them the drafts a
row keeps (``ReqPoolState.on_drafts_taken``), position by position where a state changes the next
draw (``DrawPlan.stateful``).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import msgspec
import torch

from protocol.messages import ForwardBatch


@dataclass(frozen=True)
class DrawPlan:
    """The logits rows a batch draws from, in order: each sampling row's last ``1 + draft`` positions
    (a plain row's last one), and per sampling row where its rows start and what it drafted."""

    hidden_rows: list[int]  # per logits row: its token's index in the batch's hidden states
    batch_rows: list[int]  # per logits row: the batch row it belongs to
    req_pool_idx: list[int]  # per logits row
    positions: list[int]  # per logits row: the position of the token it draws
    starts: list[int]  # per sampling row: its first logits row
    drafts: list[list[int]]  # per sampling row: its drafted tokens ([] for a plain row)

    @classmethod
    def of(cls, batch: ForwardBatch) -> DrawPlan:
        ends = list(accumulate(batch.extend_lens))
        hidden_rows: list[int] = []
        batch_rows: list[int] = []
        req_pool_idx: list[int] = []
        positions: list[int] = []
        starts: list[int] = []
        drafts: list[list[int]] = []
        for i, flag in enumerate(batch.sample):
            if not flag:
                continue
            d = batch.draft_lens[i] if batch.draft_lens else 0
            starts.append(len(hidden_rows))
            drafts.append(batch.input_ids[ends[i] - d : ends[i]])
            first_drawn = batch.prefix_lens[i] + batch.extend_lens[i] - d  # drawn by its first row
            for j in range(d + 1):
                hidden_rows.append(ends[i] - 1 - d + j)
                batch_rows.append(i)
                req_pool_idx.append(batch.req_pool_idx[i])
                positions.append(first_drawn + j)
        return cls(hidden_rows, batch_rows, req_pool_idx, positions, starts, drafts)

    @property
    def has_drafts(self) -> bool:
        return len(self.hidden_rows) > len(self.starts)

    def kept(self, drawn: list[int]) -> tuple[list[int], list[int]]:
        """(the logits rows whose draws are emitted, in order; how many per sampling row), given
        ``drawn`` per logits row (rows past a row's first differing draft are never read)."""
        out: list[int] = []
        counts: list[int] = []
        for start, draft in zip(self.starts, self.drafts, strict=True):
            n = 0
            while n < len(draft) and drawn[start + n] == draft[n]:
                n += 1
            out.extend(range(start, start + n + 1))
            counts.append(n + 1)
        return out, counts


def committed(batch: ForwardBatch, input_ids: torch.Tensor) -> tuple[ForwardBatch, torch.Tensor]:
    """The batch and its input ids as the per-request states see them: without any row's drafts (a
    draft is an input only once it is kept)."""
    if not any(batch.draft_lens):
        return batch, input_ids
    keep: list[int] = []
    start = 0
    for n, d in zip(batch.extend_lens, batch.draft_lens, strict=True):
        keep.extend(range(start, start + n - d))
        start += n
    lens = [n - d for n, d in zip(batch.extend_lens, batch.draft_lens, strict=True)]
    view = msgspec.structs.replace(
        batch, extend_lens=lens, input_ids=[batch.input_ids[k] for k in keep], draft_lens=[]
    )
    return view, input_ids.index_select(0, torch.tensor(keep, dtype=torch.int64, device=input_ids.device))
