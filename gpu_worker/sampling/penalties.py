"""Penalties, logit_bias and min_tokens (protocol's WorkerPenalties) on the rows that use them.

Per request, in its req_pool_idx's row, the worker keeps (allocated the first time a request uses
penalties: a server whose clients never do pays nothing):

    seen      [max_running_requests, vocab] bool: the token occurs in the prompt or the output
    counts    [max_running_requests, vocab] int32: how often the token was generated
    seen_ids  [max_running_requests, width]: the seen tokens in first-seen order, ``num_seen`` per row

Repetition, frequency and presence change only seen tokens, so a step gathers each row's
logits at its ``seen_ids`` ([rows, seen] values, not [rows, vocab]), penalizes them and
scatters them back: the cost follows the tokens a request has, not the vocabulary.

The tables are filled from the tokens the worker runs, never from what it draws: a row's
inputs are exactly its positions [prefix_len, prefix_len + extend_len), so when it samples
position p every position below p has been counted, however the scheduler chunked the
prompt. A decode row's input is the token its request drew last (PENDING resolved, under
overlap), so the counts follow the tokens actually emitted, and a token drawn for a request
that then ended is never an input and never counted. A req_pool_idx given to a request (a new one,
or a retracted one sent again) starts from zero and gets the tokens of its cached prefix in
``ForwardBatch.prefix_ids``; the recompute's inputs do the rest.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from protocol.messages import ForwardBatch
from protocol.sampling import WorkerPenalties, WorkerSampling


class _Tables:
    """The per-request state (see the module docstring): tables on the logits' device, ``num_seen``
    on the CPU so that choosing widths needs no device sync.

    Invariant: a request's rows of ``seen`` and ``counts`` are zero outside its seen ids, so a reset
    clears just those. Every op here touches [rows, seen] elements through flat indices
    (index_select, index_add_, index_copy_): on a CPU the ops torch parallelizes (advanced
    indexing, whole-row copies) each cost a scheduler time slice when a core is busy elsewhere.
    """

    def __init__(self, max_requests: int, vocab: int, device: torch.device, dtype: torch.dtype) -> None:
        self.vocab = vocab
        self.seen = torch.zeros(
            max_requests * vocab, dtype=torch.bool, device=device
        )  # [req_pool_idx * vocab + id]
        self.counts = torch.zeros(max_requests * vocab, dtype=torch.int32, device=device)
        self.seen_ids = torch.zeros(max_requests, 64, dtype=torch.int64, device=device)
        self.num_seen = torch.zeros(max_requests, dtype=torch.int64)
        self.presence = torch.zeros(max_requests, dtype=dtype, device=device)
        self.frequency = torch.zeros(max_requests, dtype=dtype, device=device)
        self.repetition = torch.ones(max_requests, dtype=dtype, device=device)
        # logit_bias as padded rows: id 0 with value 0.0 pads (adding 0 changes nothing).
        self.bias_ids = torch.zeros(max_requests, 0, dtype=torch.int64, device=device)
        self.bias_values = torch.zeros(max_requests, 0, dtype=dtype, device=device)

    def reset(self, idx: int, p: WorkerPenalties) -> None:
        old = self.seen_ids[idx, : int(self.num_seen[idx])] + idx * self.vocab
        self.seen.index_fill_(0, old, False)
        self.counts.index_fill_(0, old, 0)
        self.num_seen[idx] = 0
        self.presence[idx] = p.presence
        self.frequency[idx] = p.frequency
        self.repetition[idx] = p.repetition
        width = len(p.bias_ids)
        if width > self.bias_ids.shape[1]:
            grow = width - self.bias_ids.shape[1]
            self.bias_ids = torch.nn.functional.pad(self.bias_ids, (0, grow))
            self.bias_values = torch.nn.functional.pad(self.bias_values, (0, grow))
        self.bias_ids[idx] = 0
        self.bias_values[idx] = 0
        self.bias_ids[idx, :width] = torch.tensor(p.bias_ids, dtype=torch.int64)
        self.bias_values[idx, :width] = torch.tensor(p.bias_values, dtype=torch.float64)

    def copy_request(self, src: int, dst: int, p: WorkerPenalties) -> None:
        """Slot ``dst`` starts with penalties ``p`` and ``src``'s seen tokens and counts."""
        self.reset(dst, p)
        num_seen = int(self.num_seen[src])
        ids = self.seen_ids[src, :num_seen]
        src_keys, dst_keys = ids + src * self.vocab, ids + dst * self.vocab
        self.seen.index_fill_(0, dst_keys, True)
        self.counts.index_copy_(0, dst_keys, self.counts.index_select(0, src_keys))
        self.seen_ids[dst, :num_seen] = ids
        self.num_seen[dst] = num_seen

    def add_generated(self, key: torch.Tensor) -> None:
        """One more generated token at each (req_pool_idx * vocab + id) ``key`` (repeats count each time)."""
        self.counts.index_add_(0, key, torch.ones_like(key, dtype=torch.int32))

    def add_seen(self, key: torch.Tensor) -> None:
        """Mark the (req_pool_idx * vocab + id) ``key``s seen, appending the new ones to their requests'
        seen_ids. The keys are distinct and a request's keys adjacent (sorted, or one per request)."""
        new = key[~self.seen.index_select(0, key)]
        if not new.numel():
            return
        self.seen.index_fill_(0, new, True)
        idx, token = new // self.vocab, new % self.vocab
        # Rank of each new key within its request (a request's keys are adjacent): its column offset.
        index = torch.arange(len(new), device=new.device)
        first = torch.ones_like(new, dtype=torch.bool)
        first[1:] = idx[1:] != idx[:-1]
        rank = index - torch.where(first, index, 0).cummax(0).values
        idx_cpu = idx.cpu()
        column = self.num_seen.index_select(0, idx_cpu) + rank.cpu()
        width = int(column.max()) + 1
        if width > self.seen_ids.shape[1]:
            grow = max(width, 2 * self.seen_ids.shape[1]) - self.seen_ids.shape[1]
            self.seen_ids = torch.nn.functional.pad(self.seen_ids, (0, grow))
        where = idx * self.seen_ids.shape[1] + column.to(new.device)
        self.seen_ids.view(-1).index_copy_(0, where, token)
        self.num_seen.index_add_(0, idx_cpu, torch.ones_like(idx_cpu))


class ReqPoolPenalties:
    """Which requests use penalties (``WorkerPenalties`` per req_pool_idx, None for most), their tables,
    and the two steps of a batch: ``update`` from its samplers and input tokens, then ``apply`` to its
    logits."""

    def __init__(self, max_requests: int, vocab: int, device: torch.device, dtype: torch.dtype) -> None:
        self.vocab = vocab
        self._max_requests = max_requests
        self._device = device
        self._dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.params: list[WorkerPenalties | None] = [None] * max_requests
        self._tables: _Tables | None = None

    def _get_tables(self) -> _Tables:
        if self._tables is None:
            self._tables = _Tables(self._max_requests, self.vocab, self._device, self._dtype)
        return self._tables

    def on_batch(self, batch: ForwardBatch, input_ids: torch.Tensor) -> None:
        """ReqPoolState: the batch's tokens, then its forks from their parents' prompt state."""
        self.update(batch, input_ids)
        if batch.fork_rows:
            parents = [batch.req_pool_idx[i] for i in batch.fork_rows]
            self.fork(parents, batch.fork_req_pool_idx, batch.fork_samplers)

    def on_drafts_taken(self, req_pool_idx: list[int], positions: list[int], tokens: list[int]) -> None:
        """ReqPoolState: kept drafts count as the generated inputs they now are."""
        rows = [i for i, idx in enumerate(req_pool_idx) if self.params[idx] is not None]
        if rows:
            ids = torch.tensor([tokens[i] for i in rows], dtype=torch.int64, device=self._device)
            where = [positions[i] for i in rows]
            self._record([req_pool_idx[i] for i in rows], where, [1] * len(rows), list(range(len(rows))), ids)

    def update(self, batch: ForwardBatch, input_ids: torch.Tensor) -> None:
        """Take the batch's new samplers (a req_pool_idx given to a request starts from zero and its
        cached prefix), then count its input tokens (PENDING already resolved in ``input_ids``)."""
        for i, (idx, sampler) in enumerate(zip(batch.req_pool_idx, batch.sampler, strict=True)):
            if sampler is None:
                continue
            self.params[idx] = sampler.penalties
            if sampler.penalties is not None:
                self._get_tables().reset(idx, sampler.penalties)
                if batch.prefix_ids and batch.prefix_ids[i]:
                    prefix = torch.tensor(batch.prefix_ids[i], dtype=torch.int64, device=self._device)
                    self._record([idx], [0], [len(prefix)], [0], prefix)
        rows = [i for i, idx in enumerate(batch.req_pool_idx) if self.params[idx] is not None]
        if rows:
            starts = list(accumulate(batch.extend_lens, initial=0))
            self._record(
                [batch.req_pool_idx[i] for i in rows],
                [batch.prefix_lens[i] for i in rows],
                [batch.extend_lens[i] for i in rows],
                [starts[i] for i in rows],
                input_ids,
            )

    def fork(self, parents: list[int], req_pool_idx: list[int], samplers: list[WorkerSampling]) -> None:
        """Each fork takes its sampler's penalties and its parent's counts (the prompt's
        tokens: a fork starts where its parent's prompt ends)."""
        for parent, idx, sampler in zip(parents, req_pool_idx, samplers, strict=True):
            self.params[idx] = sampler.penalties
            if sampler.penalties is not None:
                self._get_tables().copy_request(parent, idx, sampler.penalties)

    def _record(
        self,
        req_pool_idx: list[int],
        positions: list[int],
        lens: list[int],
        offsets: list[int],
        tokens: torch.Tensor,
    ) -> None:
        """Count ``tokens[offsets[r] : offsets[r] + lens[r]]``, at positions from ``positions[r]``,
        for request ``req_pool_idx[r]``: every one as seen, those past the prompt as generated."""
        tables = self._get_tables()
        num_tokens = sum(lens)
        decode_only = num_tokens == len(lens)  # one token a row, at distinct req_pool_idx
        flat, pos, req_pool_idx_of = (
            torch.tensor(offsets),
            torch.tensor(positions),
            torch.tensor(req_pool_idx),
        )
        prompt_len = torch.tensor(
            [p.prompt_len if (p := self.params[s]) is not None else 0 for s in req_pool_idx]
        )
        if not decode_only:
            lens_t = torch.tensor(lens)
            row = torch.repeat_interleave(torch.arange(len(lens)), lens_t)
            within = torch.arange(num_tokens) - torch.repeat_interleave(lens_t.cumsum(0) - lens_t, lens_t)
            flat, pos = flat[row] + within, pos[row] + within
            req_pool_idx_of, prompt_len = req_pool_idx_of[row], prompt_len[row]
        generated = pos >= prompt_len
        key = req_pool_idx_of.to(self._device) * self.vocab + tokens.index_select(0, flat.to(self._device))
        if bool(generated.all()):
            tables.add_generated(key)
        elif bool(generated.any()):
            tables.add_generated(key[generated.to(self._device)])
        tables.add_seen(key if decode_only else torch.unique(key))

    def apply(self, logits: torch.Tensor, req_pool_idx: list[int], positions: list[int]) -> torch.Tensor:
        """``logits`` [rows, vocab] of the sampled rows at ``req_pool_idx``, drawing ``positions``, with every
        row's penalties applied (float32, or float64 for float64 logits; float32 logits are changed
        in place); the same tensor when no row uses any (the fast path: one list scan)."""
        rows = [i for i, idx in enumerate(req_pool_idx) if self.params[idx] is not None]
        if not rows:
            return logits
        tables = self._get_tables()
        params = [p for i in rows if (p := self.params[req_pool_idx[i]]) is not None]
        x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
        x = x.contiguous()
        row_req_pool_idx = [req_pool_idx[i] for i in rows]
        row_t = torch.tensor(rows, dtype=torch.int64, device=x.device)
        req_pool_idx_t = torch.tensor(row_req_pool_idx, dtype=torch.int64, device=x.device)
        repetition = any(p.repetition != 1 for p in params)
        if repetition or any(p.presence != 0 or p.frequency != 0 for p in params):
            num_seen = tables.num_seen.index_select(0, torch.tensor(row_req_pool_idx))
            self._penalize_seen(x, row_t, req_pool_idx_t, num_seen, repetition)
        if any(p.bias_ids for p in params):
            where = row_t[:, None] * self.vocab + tables.bias_ids.index_select(0, req_pool_idx_t)
            bias = tables.bias_values.index_select(0, req_pool_idx_t).to(x.dtype)
            x.view(-1).index_add_(0, where.view(-1), bias.view(-1))
        _mask_min_tokens(x, rows, params, [positions[i] for i in rows])
        return x

    def _penalize_seen(
        self,
        x: torch.Tensor,
        row_t: torch.Tensor,
        req_pool_idx_t: torch.Tensor,
        num_seen: torch.Tensor,
        repetition: bool,
    ) -> None:
        """Repetition, then frequency and presence, in place on each penalized row's seen tokens."""
        tables = self._get_tables()
        width = int(num_seen.max())
        if width == 0:
            return
        # Columns past a row's num_seen repeat its first seen id: the same value is computed and
        # written twice, so the padding changes nothing. A row that has seen nothing (never so
        # when it samples: its prompt is seen) has a stale id there, which its unit repetition and
        # zero counts leave as it is.
        ids = tables.seen_ids.index_select(0, req_pool_idx_t)[:, :width]
        live = torch.arange(width)[None, :] < num_seen[:, None]
        ids = torch.where(live.to(ids.device), ids, ids[:, :1])
        where = (row_t[:, None] * self.vocab + ids).view(-1)
        values = x.view(-1).index_select(0, where).view(ids.shape)
        if repetition:
            rep = tables.repetition.index_select(0, req_pool_idx_t).to(x.dtype)
            rep = torch.where((num_seen > 0).to(rep.device), rep, 1.0)[:, None]
            values = torch.where(values > 0, values / rep, values * rep)
        count = tables.counts.index_select(0, (req_pool_idx_t[:, None] * self.vocab + ids).view(-1))
        count = count.view(ids.shape).to(x.dtype)
        frequency = tables.frequency.index_select(0, req_pool_idx_t).to(x.dtype)[:, None]
        presence = tables.presence.index_select(0, req_pool_idx_t).to(x.dtype)[:, None]
        values = values - (frequency * count + presence * (count > 0))
        x.view(-1).index_copy_(0, where, values.view(-1))


def _mask_min_tokens(
    x: torch.Tensor, rows: list[int], params: list[WorkerPenalties], positions: list[int]
) -> None:
    """-inf, in place, on the EOS and stop token ids of each row (``rows[r]`` of ``x``) that has
    generated fewer than its min_tokens."""
    where = [
        row * x.shape[1] + t
        for row, p, pos in zip(rows, params, positions, strict=True)
        if pos - p.prompt_len < p.min_tokens
        for t in p.min_tokens_ids
    ]
    if where:
        x.view(-1).index_fill_(0, torch.tensor(where, dtype=torch.int64, device=x.device), float("-inf"))
