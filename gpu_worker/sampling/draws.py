"""A batch's draws from its logits: penalties, grammar masks, greedy or seeded sampling, logprobs,
and which drafts its verify rows keep (verify.py).

The logits rows are a ``DrawPlan``'s (every sampling row's last position, a verify row's last
1 + d), then the forks' (n > 1: copies of their rows'). Each row's logits get its request's
penalties, then its grammar mask; then the batch draws greedy (the backend's argmax) or samples
(sampler.py). Logprobs and top-N are computed for the emitted draws whose request asked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gpu_worker.forks import with_forks
from gpu_worker.sampling import ReqPoolState
from gpu_worker.sampling.grammar import ReqPoolGrammars
from gpu_worker.sampling.logprobs import ReqPoolTopLogprobs, asked_logprobs
from gpu_worker.sampling.penalties import ReqPoolPenalties
from gpu_worker.sampling.sampler import ReqPoolSamplerParams, sample
from gpu_worker.sampling.verify import DrawPlan
from protocol.logprobs import TopTokens
from protocol.messages import ForwardBatch


@dataclass
class Drawn:
    """What a batch drew: the emitted tokens (a verify row's kept drafts, then its draw; then the
    forks'), their logprobs where asked (else []), top-N where asked (else []), the tokens per
    sampling row when the batch had drafts (else []), and each drawing request's last token."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[TopTokens] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    last_req_pool_idx: list[int] = field(default_factory=list)
    last_tokens: list[int] = field(default_factory=list)


class BatchDraws:
    """Draws each batch's tokens from the per-request sampling states the runner keeps."""

    def __init__(
        self,
        params: ReqPoolSamplerParams,
        top_logprobs: ReqPoolTopLogprobs,
        penalties: ReqPoolPenalties,
        grammars: ReqPoolGrammars,
        greedy: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.params, self.top_logprobs = params, top_logprobs
        self.penalties, self.grammars = penalties, grammars
        self.greedy = greedy  # the backend's argmax
        self.states: tuple[ReqPoolState, ...] = (params, top_logprobs, penalties, grammars)

    def draw(self, logits: torch.Tensor, plan: DrawPlan, batch: ForwardBatch) -> Drawn:
        """The batch's draws from ``logits`` (the plan's rows, in its order)."""
        if self.argmax_alone(plan, batch):
            # What the steps below come to for such a batch, without their dozen calls (a one-row
            # step's Python: docs/benchmarks-history.md): one emitted draw per row, no logprobs.
            return self.argmax_drawn(self.greedy(logits), plan)
        logits, req_pool_idx, positions = with_forks(
            logits, plan.req_pool_idx, plan.positions, plan.batch_rows, batch
        )
        if plan.has_drafts and self._stateful(plan):
            logits, tokens, token_logprobs = self._draw_by_position(logits, req_pool_idx, positions, plan)
        else:
            logits, tokens, token_logprobs = self._draw(logits, req_pool_idx, positions)
        drawn = tokens.tolist()
        emitted, counts = plan.kept(drawn)
        emitted += range(len(plan.hidden_rows), len(req_pool_idx))  # the forks'
        last = _last_of_each(emitted, counts)
        out = Drawn(
            token_ids=[drawn[i] for i in emitted],
            logprobs=[token_logprobs[i] for i in emitted] if token_logprobs is not None else [],
            num_tokens=counts if plan.has_drafts else [],
            last_req_pool_idx=[req_pool_idx[i] for i in last],
            last_tokens=[drawn[i] for i in last],
        )
        out_req_pool_idx = [req_pool_idx[i] for i in emitted]
        want = [self.params.logprobs[s] for s in out_req_pool_idx]
        # Greedy rows' logprobs, and top-N (with the chosen token's logprob from the same normalizer,
        # so the two are bit-equal), for the rows that asked only; top_logprobs > 0 implies logprobs.
        if self.top_logprobs.wants_top(out_req_pool_idx) or (token_logprobs is None and any(want)):
            index = torch.tensor(emitted, dtype=torch.int64, device=logits.device)
            top_n = [self.top_logprobs.top_n[s] for s in out_req_pool_idx]
            out.logprobs, out.top = asked_logprobs(
                logits.index_select(0, index), tokens.index_select(0, index), want, top_n, out.logprobs
            )
        return out

    def _draw(
        self, logits: torch.Tensor, req_pool_idx: list[int], positions: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, list[float] | None]:
        """(the processed logits, the tokens drawn, their logprobs or None for an all-greedy batch)."""
        logits = self.penalties.apply(logits, req_pool_idx, positions)  # before greedy's argmax too
        # The grammar mask after the penalties: greedy and sampled rows draw from the masked logits,
        # and a grammar row's logprobs are those of the masked distribution, the one it was drawn from.
        logits = self.grammars.apply(logits, req_pool_idx)
        if self.params.plain_greedy(req_pool_idx):
            return logits, self.greedy(logits), None
        tokens, token_logprobs = sample(logits, self.params.batch(req_pool_idx, positions, logits.device))
        return logits, tokens, token_logprobs.tolist() if token_logprobs is not None else None

    def argmax_alone(self, plan: DrawPlan, batch: ForwardBatch) -> bool:
        """The batch's draw is its logits' argmax: no drafts, no forks, every row greedy with no
        penalties, grammar, logprobs or top-N (the runner may then take the argmax from the head:
        head_argmax.py)."""
        return not plan.has_drafts and not batch.fork_rows and self._argmax_alone(plan.req_pool_idx)

    @staticmethod
    def argmax_drawn(tokens: torch.Tensor, plan: DrawPlan) -> Drawn:
        """What an ``argmax_alone`` batch draws, given its rows' argmax ``tokens``: one draw per row."""
        ids = tokens.tolist()
        return Drawn(token_ids=ids, last_req_pool_idx=plan.req_pool_idx, last_tokens=ids)

    def _argmax_alone(self, req_pool_idx: list[int]) -> bool:
        """Every row greedy, with no penalties, grammar, logprobs or top-N: its draw is the argmax."""
        greedy, logprobs, top_n = self.params.greedy, self.params.logprobs, self.top_logprobs.top_n
        penalties, matchers = self.penalties.params, self.grammars.matchers
        return all(
            greedy[s] and not logprobs[s] and not top_n[s] and penalties[s] is None and matchers[s] is None
            for s in req_pool_idx
        )

    def _stateful(self, plan: DrawPlan) -> bool:
        """Some verify row's request has penalties or a grammar: its draw at a drafted position depends
        on the drafts before it having been taken."""
        req_pool_idx = [
            plan.req_pool_idx[start] for start, draft in zip(plan.starts, plan.drafts, strict=True) if draft
        ]
        return any(
            self.penalties.params[s] is not None or self.grammars.matchers[s] is not None
            for s in req_pool_idx
        )

    def _draw_by_position(
        self, logits: torch.Tensor, req_pool_idx: list[int], positions: list[int], plan: DrawPlan
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        """``_draw`` position by position: each verify row's next logits row is drawn only after the
        per-request states took the draft before it (and only while its drafts are kept). Logprobs are
        left to ``asked_logprobs`` (the rows' draws may mix greedy and sampled steps)."""
        wide = torch.float64 if logits.dtype == torch.float64 else torch.float32
        processed = torch.empty(logits.shape, dtype=wide, device=logits.device)
        tokens = torch.zeros(len(req_pool_idx), dtype=torch.int64, device=logits.device)
        rows = list(plan.starts) + list(range(len(plan.hidden_rows), len(req_pool_idx)))  # forks draw first
        step = 0
        while rows:
            index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            part, part_tokens, _ = self._draw(
                logits.index_select(0, index), [req_pool_idx[i] for i in rows], [positions[i] for i in rows]
            )
            processed.index_copy_(0, index, part.to(wide))
            tokens.index_copy_(0, index, part_tokens)
            rows = self._take_drafts(plan, step, tokens, positions)
            step += 1
        return processed, tokens, None

    def _take_drafts(
        self, plan: DrawPlan, step: int, tokens: torch.Tensor, positions: list[int]
    ) -> list[int]:
        """The logits rows after each verify row's draft ``step`` where that draft equals the draw
        there: the states take the draft, and those rows are drawn next."""
        taken = [
            (start + step, draft[step])
            for start, draft in zip(plan.starts, plan.drafts, strict=True)
            if step < len(draft) and int(tokens[start + step]) == draft[step]
        ]
        if taken:
            rows = [i for i, _ in taken]
            req_pool_idx, where = [plan.req_pool_idx[i] for i in rows], [positions[i] for i in rows]
            for state in self.states:
                state.on_drafts_taken(req_pool_idx, where, [token for _, token in taken])
        return [i + 1 for i, _ in taken]


def _last_of_each(emitted: list[int], counts: list[int]) -> list[int]:
    """The last emitted logits row of each sampling row (``counts`` of them each), then each fork's."""
    out, k = [], 0
    for n in counts:
        k += n
        out.append(emitted[k - 1])
    return out + emitted[k:]
