"""Logprobs beyond the chosen token's: top-N alternatives of sampled rows, and prompt logprobs.

Both are computed only for the rows that asked: a batch where nobody asked for top-N or prompt
logprobs never gets here (the runner checks ``wants_top`` and ``ForwardBatch.prompt_logprob_lens``),
so the common batch keeps its fast path. A logprob is ``logit - logsumexp(logits)`` of the raw
logits, in float32 (float64 for a float64 model), as the chosen token's in sampler.py.

Where a row asked for top-N, its chosen token's logprob is recomputed from the same normalizer
as its alternatives, so the chosen token and its own top-N entry are bit-equal (clients such as
lm-evaluation-harness test greediness with ``logprob == max(top_logprobs)``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate

import torch

from protocol.logprobs import TopTokens
from protocol.messages import ForwardBatch
from protocol.sampling import WorkerSampling

# Prompt positions whose logits are materialized at once: [256, vocab] float32 is 50 MB for a
# 49k vocabulary, where a whole 2k-token chunk's would be 400 MB.
PROMPT_BLOCK_POSITIONS = 256
NO_TOP = TopTokens([], [])
NEG_INF = float("-inf")


class ReqPoolTopLogprobs:
    """How many alternatives each request asked for, set when its req_pool_idx is (re)assigned."""

    def __init__(self, max_requests: int) -> None:
        self.top_n = [0] * max_requests

    def on_batch(self, batch: ForwardBatch, input_ids: torch.Tensor) -> None:
        """ReqPoolState: the settings of the batch's rows and forks."""
        self.update(batch.req_pool_idx, batch.sampler)
        self.update(batch.fork_req_pool_idx, batch.fork_samplers)

    def on_drafts_taken(self, req_pool_idx: list[int], positions: list[int], tokens: list[int]) -> None:
        """ReqPoolState: settings do not follow tokens."""

    def update(self, req_pool_idx: list[int], params: Sequence[WorkerSampling | None]) -> None:
        for idx, p in zip(req_pool_idx, params, strict=True):
            if p is not None:
                self.top_n[idx] = p.top_logprobs

    def wants_top(self, req_pool_idx: list[int]) -> bool:
        return any(self.top_n[s] for s in req_pool_idx)


def _wide(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.dtype == torch.float64 else logits.float()


def asked_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, want: list[bool], top_n: list[int], chosen: list[float]
) -> tuple[list[float], list[TopTokens]]:
    """The logprobs of the sampled rows that asked (``want``; 0.0 for the others, or as ``chosen``
    has them when given) and the top ``top_n[i]`` tokens of each row (NO_TOP where 0; [] when no
    row asked for any), from one logsumexp and one top-k over just the rows that asked."""
    rows = [i for i, w in enumerate(want) if w]
    out = list(chosen) if chosen else [0.0] * len(want)
    if not rows:
        return out, []
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    wide = _wide(logits.index_select(0, index))
    log_total = torch.logsumexp(wide, dim=-1)
    picked = (wide.gather(1, tokens.index_select(0, index)[:, None]).squeeze(1) - log_total).tolist()
    for i, logprob in zip(rows, picked, strict=True):
        out[i] = logprob
    k = min(max(top_n[i] for i in rows), wide.shape[-1])
    if k == 0:
        return out, []
    values, ids = wide.topk(k, dim=-1)
    values = values - log_total[:, None]
    top = [NO_TOP] * len(want)
    for i, row_ids, row_values in zip(rows, ids.tolist(), values.tolist(), strict=True):
        # A token masked to -inf (a grammar, min_tokens) cannot be drawn: it is no alternative.
        n = sum(v != NEG_INF for v in row_values[: top_n[i]])
        top[i] = TopTokens(row_ids[:n], row_values[:n])
    return out, top


def prompt_positions(batch: ForwardBatch) -> list[int]:
    """Indices into the batch's flat tokens of the positions whose prompt logprobs are wanted."""
    starts = [0, *accumulate(batch.extend_lens)]
    return [starts[i] + k for i, n in enumerate(batch.prompt_logprob_lens) for k in range(n)]


def prompt_logprobs(
    hidden: torch.Tensor,
    batch: ForwardBatch,
    top: ReqPoolTopLogprobs,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[list[float], list[TopTokens]]:
    """(logprob of each wanted position's next token, the top-N at each, or [] when none asked),
    in blocks of PROMPT_BLOCK_POSITIONS positions through ``compute_logits`` (norm + head).
    ([], []) for a batch that wants no prompt logprobs."""
    if not batch.prompt_logprob_lens:
        return [], []
    positions = prompt_positions(batch)
    top_n = [top.top_n[idx] for idx, n in zip(batch.req_pool_idx, batch.prompt_logprob_lens, strict=True)
             for _ in range(n)]  # fmt: skip
    device = hidden.device
    targets = torch.tensor(batch.prompt_logprob_targets, dtype=torch.int64, device=device)
    logprobs: list[float] = []
    tops: list[TopTokens] = []
    for begin in range(0, len(positions), PROMPT_BLOCK_POSITIONS):
        end = begin + PROMPT_BLOCK_POSITIONS
        index = torch.tensor(positions[begin:end], dtype=torch.int64, device=device)
        wide = _wide(compute_logits(hidden.index_select(0, index)))
        log_total = torch.logsumexp(wide, dim=-1)
        logprobs += (wide.gather(1, targets[begin:end, None]).squeeze(1) - log_total).tolist()
        k = min(max(top_n[begin:end]), wide.shape[-1])
        if k > 0:
            values, ids = wide.topk(k, dim=-1)
            values = values - log_total[:, None]
            for n, row_ids, row_values in zip(top_n[begin:end], ids.tolist(), values.tolist(), strict=True):
                tops.append(TopTokens(row_ids[:n], row_values[:n]))
        elif any(top_n):
            tops += [NO_TOP] * len(index)
    return logprobs, tops
