"""Test helpers: a fake worker that checks the ForwardBatch contract, and a driver loop.

The fake worker's tokens are a pure function of the token sequence already in a
request's KV (a rolling hash of fill_ids), so chunking, batching, retraction and
recompute must all give the same tokens as ``reference_output``.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from protocol.embedding import Pooling
from protocol.messages import (
    PENDING,
    FinishReason,
    ForwardBatch,
    ForwardResult,
    RequestError,
    TokenBatch,
    TokenizedRequest,
)
from protocol.sampling import WorkerSampling
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.request import ReqStatus
from scheduler_proc.scheduler import Scheduler

VOCAB = 1000
HASH_MOD = (1 << 61) - 1


def next_hash(h: int, token: int) -> int:
    return (h * 1_000_003 + token + 7) % HASH_MOD


def token_of(h: int) -> int:
    return (h >> 11) % VOCAB


def sampler(seed: int = 0) -> WorkerSampling:
    return WorkerSampling(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=seed)


def fixed_ratio(ratio: float) -> dict[str, Any]:
    """SchedulerConfig fields that pin new_token_ratio at ``ratio`` (no decay)."""
    return {"schedule_conservativeness": ratio / 0.7, "new_token_ratio_decay_steps": 0}


def tokenized(
    rid: int,
    prompt: list[int],
    max_new: int,
    stop: Iterable[int] = (),
    salt: str | None = None,
    prompt_logprobs: bool = False,
    n: int = 1,
    pooling: Pooling | None = None,
) -> TokenizedRequest:
    return TokenizedRequest(
        rid=rid,
        input_ids=prompt,
        max_new_tokens=max_new,
        stop_token_ids=list(stop),
        sampler=sampler(rid),
        cache_salt=salt,
        prompt_logprobs=prompt_logprobs,
        n=n,
        pooling=pooling,
    )


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def small_config(**overrides: Any) -> SchedulerConfig:
    """A small pool of 4-token pages, 64-token chunks; ``overrides`` set any other field."""
    base: dict[str, Any] = dict(num_pages=256, context_len=512, page_size=4, chunked_prefill_size=64)
    base.update(overrides)
    return SchedulerConfig(**base)


def fork_token(h: int, choice: int) -> int:
    """The first token of choice ``choice`` of an n > 1 request whose prompt hashes to ``h``: the
    fake worker draws choice i (its seed the leader's + i) from the same logits, differently."""
    return token_of(h if choice == 0 else next_hash(next_hash(h, VOCAB + choice), 0))


def reference_output(
    prompt: list[int], max_new: int, stop: Iterable[int], context_len: int, choice: int = 0
) -> tuple[list[int], FinishReason]:
    """What the fake worker yields for a request run alone, start to end (choice ``choice`` of an
    n > 1 request: only its first token differs)."""
    stop_set = set(stop)
    h = 0
    for tok in prompt:
        h = next_hash(h, tok)
    out: list[int] = []
    while True:
        tok = fork_token(h, choice) if not out else token_of(h)
        out.append(tok)
        if tok in stop_set:
            return out, FinishReason.STOP
        if len(out) >= max_new or len(prompt) + len(out) >= context_len:
            return out, FinishReason.LENGTH
        h = next_hash(h, tok)


class FakeWorker:
    """Consumes ForwardBatch like the GPU worker would, asserting the contract on the way.

    KV is modelled per position as (token, hash of the sequence up to it). A row
    reads its prefix through its req_pool_idx's page table: pages it has not read since
    they were last written are checked to hold one unbroken hash chain, so a
    prefix shared from another request must hold exactly the right tokens, and a
    page overwritten while a req_pool_idx still uses it is caught the moment it is read.
    Tokens are a pure function of the sequence, as in ``reference_output``.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.page_size = config.page_size
        self.num_pages = config.num_pages
        self.max_requests = config.max_running_requests
        self.tables: dict[int, list[int]] = {}
        self.content: dict[tuple[int, int], tuple[int, int]] = {}  # (page, offset) -> (token, hash)
        self.gen: dict[int, int] = {}  # page -> how many times one of its positions was overwritten
        self.seen: dict[
            int, dict[int, int]
        ] = {}  # req_pool_idx -> page -> gen when the req_pool_idx last read or wrote it
        self.fail_next: str | None = None
        self.extend_tokens = 0  # prompt and decode tokens computed, over all batches
        self.last_token: dict[int, int] = {}  # req_pool_idx -> the token its last sampling row drew
        self.seeds: dict[int, int] = {}  # req_pool_idx -> its sampler's seed
        self.hashes: list[int] = []  # the last batch's: hash at each sampling row's last position

    def _at(self, idx: int, pos: int) -> tuple[int, int]:
        table = self.tables[idx]
        assert pos // self.page_size < len(table), f"req_pool_idx {idx}: position {pos} has no page"
        page = table[pos // self.page_size]
        kv = self.content.get((page, pos % self.page_size))
        assert kv is not None, f"req_pool_idx {idx}: position {pos} read before it was written"
        return kv

    def _check_prefix(self, idx: int, prefix: int) -> int:
        """The hash at ``prefix - 1`` (0 for none), checking pages this request has not seen as they are."""
        seen, ps = self.seen[idx], self.page_size
        for j in range(-(-prefix // ps)):
            page = self.tables[idx][j]
            if seen.get(page) == self.gen.get(page, 0):
                continue
            h = self._at(idx, j * ps - 1)[1] if j else 0
            for pos in range(j * ps, min((j + 1) * ps, prefix)):
                tok, stored = self._at(idx, pos)
                assert stored == next_hash(h, tok), f"req_pool_idx {idx}: KV at {pos} is not this sequence's"
                h = stored
            seen[page] = self.gen.get(page, 0)
        return self._at(idx, prefix - 1)[1] if prefix else 0

    def _write(self, idx: int, pos: int, tok: int, h: int) -> None:
        page = self.tables[idx][pos // self.page_size]
        if (page, pos % self.page_size) in self.content:
            self.gen[page] = self.gen.get(page, 0) + 1
        self.content[(page, pos % self.page_size)] = (tok, h)
        self.seen[idx][page] = self.gen.get(page, 0)

    def _apply_pages(self, idx: int, start: int, pages: list[int]) -> None:
        table = self.tables[idx]
        assert 0 <= start <= len(table), f"req_pool_idx {idx}: pages start at {start}, table has {len(table)}"
        for page in pages:
            assert 0 <= page < self.num_pages, f"page {page} out of range"
        table[start : start + len(pages)] = pages
        assert len(set(table)) == len(table), f"a page twice in req_pool_idx {idx}'s table"

    def run(self, batch: ForwardBatch) -> ForwardResult:
        n = len(batch.req_pool_idx)
        assert len(set(batch.req_pool_idx)) == n, "a req_pool_idx appears twice in one batch"
        for field in (
            batch.prefix_lens,
            batch.extend_lens,
            batch.page_starts,
            batch.page_counts,
            batch.sample,
            batch.sampler,
        ):
            assert len(field) == n, "ragged ForwardBatch"
        assert sum(batch.extend_lens) == len(batch.input_ids), "input_ids do not match extend_lens"
        assert sum(batch.page_counts) == len(batch.pages), "pages do not match page_counts"
        page_off = 0
        for i, idx in enumerate(
            batch.req_pool_idx
        ):  # like the worker: every page delta lands before the forward
            assert 0 <= idx < self.max_requests, f"req_pool_idx {idx} out of range"
            if (sampler := batch.sampler[i]) is not None:
                self.tables[idx], self.seen[idx], self.seeds[idx] = [], {}, sampler.seed
            assert idx in self.tables, f"req_pool_idx {idx} used before it got a sampler"
            self._apply_pages(
                idx, batch.page_starts[i], batch.pages[page_off : page_off + batch.page_counts[i]]
            )
            page_off += batch.page_counts[i]
        tokens: list[int] = []
        counts: list[int] = []  # tokens per sampling row (a verify row keeps some drafts)
        prompt_logprobs: list[float] = []
        pooled: list[list[float]] = []
        targets = iter(batch.prompt_logprob_targets)
        tok_off = 0
        for i, idx in enumerate(batch.req_pool_idx):
            prefix, ext = batch.prefix_lens[i], batch.extend_lens[i]
            assert ext >= 1, "empty row"
            h = self._check_prefix(idx, prefix)
            row_ids = batch.input_ids[tok_off : tok_off + ext]
            if PENDING in row_ids:  # the token this req_pool_idx's previous row drew (overlap scheduling)
                assert row_ids.index(PENDING) == ext - 1, "PENDING is only ever a row's last input"
                # None drawn: the row that should have failed; its request has failed with it.
                row_ids[-1] = self.last_token.get(idx, 0)
            draft = batch.draft_lens[i] if batch.draft_lens else 0
            drawn = []  # a verify row's draw at each drafted position (the rest decode rows draw)
            for pos, tok in enumerate(row_ids, start=prefix):
                h = next_hash(h, tok)
                self._write(idx, pos, tok, h)
                drawn.append(token_of(h))
            if draft:
                assert batch.sample[i] and PENDING not in batch.input_ids[tok_off : tok_off + ext]
                drafts, kept = row_ids[ext - draft :], 0
                while kept < draft and drafts[kept] == drawn[ext - draft - 1 + kept]:
                    kept += 1
                tokens.extend(drafts[:kept] + [drawn[ext - draft - 1 + kept]])
                counts.append(kept + 1)
                self.hashes.append(h)  # (forks never come from verify rows)
                tok_off += ext
                self.extend_tokens += ext
                continue
            for k in range(batch.prompt_logprob_lens[i] if batch.prompt_logprob_lens else 0):
                target = next(targets)
                assert k + 1 >= ext or row_ids[k + 1] == target, (
                    "a prompt-logprob target is not the next token"
                )
                prompt_logprobs.append(-float(target))  # the test reads the target back from it
            tok_off += ext
            self.extend_tokens += ext
            if batch.pool and batch.pool[i] is not None:  # a position's "hidden state" is [token, 1]
                last = batch.pool[i] is Pooling.LAST
                pooled.append([float(row_ids[-1]), 1.0] if last else [float(sum(row_ids)), float(ext)])
            if batch.sample[i]:
                tokens.append(token_of(h))
                counts.append(1)
                self.hashes.append(h)
        self._copy_pages(batch)
        tokens += self._fork(batch)
        if self.fail_next is not None:  # like the worker: a failed forward draws no token
            error, self.fail_next = self.fail_next, None
            return ForwardResult(step=batch.step, token_ids=[], logprobs=[], forward_s=0.0, error=error)
        sampled = [idx for idx, sample in zip(batch.req_pool_idx, batch.sample, strict=True) if sample]
        ends = [sum(counts[: k + 1]) - 1 for k in range(len(counts))]
        row_last = [tokens[e] for e in ends] + tokens[len(tokens) - len(batch.fork_req_pool_idx) :]
        self.last_token.update(zip(sampled + batch.fork_req_pool_idx, row_last, strict=True))
        return ForwardResult(
            step=batch.step,
            token_ids=tokens,
            logprobs=[-0.5] * len(tokens),
            forward_s=0.001,
            prompt_logprobs=prompt_logprobs,
            pooled=pooled,
            num_tokens=counts if batch.draft_lens else [],
        )

    def _copy_pages(self, batch: ForwardBatch) -> None:
        """After the forward, as the worker: each copy_dst page gets its copy_src page's KV."""
        assert len(batch.copy_src) == len(batch.copy_dst), "ragged page copies"
        for src, dst in zip(batch.copy_src, batch.copy_dst, strict=True):
            assert src != dst and 0 <= min(src, dst) and max(src, dst) < self.num_pages, "bad page copy"
            for off in range(self.page_size):
                kv = self.content.get((src, off))
                assert kv is not None or off > 0, f"page {src} copied before it was written"
                if kv is None:
                    self.content.pop((dst, off), None)
                else:
                    self.content[(dst, off)] = kv
            self.gen[dst] = self.gen.get(dst, 0) + 1  # every req_pool_idx reading dst checks it anew

    def _fork(self, batch: ForwardBatch) -> list[int]:
        """The forks' tokens, drawn from their rows' last positions; each fork req_pool_idx starts fresh."""
        sampled_index = {row: k for k, row in enumerate(i for i, smp in enumerate(batch.sample) if smp)}
        tokens = []
        hashes, self.hashes = self.hashes, []
        for row, idx, fork_sampler in zip(
            batch.fork_rows, batch.fork_req_pool_idx, batch.fork_samplers, strict=True
        ):
            assert row in sampled_index, "a fork of a row that does not sample"
            assert idx not in batch.req_pool_idx, "a fork req_pool_idx also has a row in its batch"
            choice = fork_sampler.seed - self.seeds[batch.req_pool_idx[row]]
            assert choice >= 1, "a fork's seed is not its leader's + its choice"
            tokens.append(fork_token(hashes[sampled_index[row]], choice))
            self.tables[idx], self.seen[idx], self.seeds[idx] = [], {}, fork_sampler.seed
        return tokens


class Driver:
    """Runs a Scheduler against a FakeWorker and records what a tokenizer would see."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.sched = Scheduler(config)
        self.worker = FakeWorker(config)
        self.tokens: dict[int, list[int]] = {}
        self.finished: dict[int, FinishReason] = {}
        self.errors: dict[int, str] = {}
        self.batches: list[ForwardBatch] = []
        self.cached: dict[int, int] = {}  # rid -> cached_tokens its rows reported
        self.prompt_logprobs: dict[int, list[float]] = {}
        self.embeddings: dict[int, list[float]] = {}
        self.pending: deque[tuple[ForwardBatch, ForwardResult]] = deque()  # sent, result not applied

    def submit(
        self,
        rid: int,
        prompt: list[int],
        max_new: int,
        stop: Iterable[int] = (),
        salt: str | None = None,
        prompt_logprobs: bool = False,
        n: int = 1,
        pooling: Pooling | None = None,
    ) -> RequestError | None:
        error = self.sched.add(tokenized(rid, prompt, max_new, stop, salt, prompt_logprobs, n, pooling))
        if error is None:
            for choice in range(n):
                self.tokens[rid + choice] = []
        return error

    def step(self, in_flight_hook: Callable[[ForwardBatch], None] | None = None) -> ForwardBatch | None:
        """Send batches while the scheduler gives them (two with overlap), then apply the oldest result.

        The fake worker runs each batch as it is sent, in order, as the real one does
        while the scheduler already builds the next.
        """
        while (batch := self.sched.schedule()) is not None:
            assert len(self.pending) < self.sched.max_in_flight, "more batches in flight than allowed"
            self.batches.append(batch)
            self.pending.append((batch, self.worker.run(batch)))
        if not self.pending:
            return None
        batch, result = self.pending.popleft()
        if in_flight_hook is not None:
            in_flight_hook(batch)
        self.sched.on_result(result)
        self.collect()
        check_invariants(self.sched)
        return batch

    def collect(self) -> None:
        outs = self.sched.take_outputs()
        assert sum(isinstance(o, TokenBatch) for o in outs) <= 1, "more than one TokenBatch per step"
        for out in outs:
            if isinstance(out, RequestError):
                assert out.rid not in self.finished and out.rid not in self.errors, (
                    f"rid {out.rid} ended twice"
                )
                self.errors[out.rid] = out.message
                continue
            assert isinstance(out, TokenBatch)
            for lp in out.prompt_logprobs:
                assert lp.rid not in self.prompt_logprobs, f"rid {lp.rid}: prompt logprobs twice"
                assert lp.rid not in self.finished, f"rid {lp.rid}: prompt logprobs after its end"
                self.prompt_logprobs[lp.rid] = lp.logprobs
            for e in out.embeddings:
                assert e.rid not in self.embeddings and e.rid not in self.finished, (
                    f"rid {e.rid}: late or twice"
                )
                self.embeddings[e.rid] = e.values
            rows = zip(out.rids, out.token_ids, out.finished, out.cached_tokens, strict=True)
            for rid, tok, reason, cached in rows:
                assert rid not in self.finished and rid not in self.errors, f"row for rid {rid} after its end"
                self.cached[rid] = max(self.cached.get(rid, 0), cached)
                if tok != -1:
                    self.tokens[rid].append(tok)
                if reason is not None:
                    self.finished[rid] = reason

    def abort(self, rid: int, reason: FinishReason = FinishReason.ABORT) -> None:
        self.sched.abort(rid, reason)
        self.collect()

    def run(self, max_steps: int = 100_000) -> None:
        """Step until idle; the scheduler must always make progress while it has work."""
        for _ in range(max_steps):
            if not self.sched.has_work and not self.pending:
                return
            assert self.step() is not None, "scheduler stalled with work and nothing in flight"
        raise AssertionError("did not finish")

    def assert_no_leak(self) -> None:
        """Idle: every page is free or cached (and flushing the cache frees them all)."""
        assert not self.sched.has_work and not self.sched.reqs
        self.sched.kv.check_integrity([])
        assert self.sched.kv.available_pages == self.config.num_pages, "pages leaked"
        assert self.sched.kv.req_pool.num_free == self.config.max_running_requests, "req_pool_idx leaked"
        self.sched.flush_cache()
        assert self.sched.kv.pages.num_free == self.config.num_pages, "flush left pages behind"


def batch_kinds(batches: list[ForwardBatch]) -> list[str]:
    """'P' prefill only, 'D' decode only, 'M' both, per batch.

    A decode row continues a req_pool_idx (no sampler), extends 1 token and samples; anything else is prefill.
    """
    out = []
    for b in batches:
        rows = list(zip(b.sampler, b.extend_lens, b.sample, strict=True))
        dec = [s is None and e == 1 and smp for s, e, smp in rows]
        out.append("M" if any(dec) and not all(dec) else "D" if all(dec) else "P")
    return out


def check_invariants(sched: Scheduler) -> None:
    """Structural invariants between steps (with overlap, the next batch may be in flight)."""
    ps = sched.config.page_size
    queued = list(sched.waiting) + sched.running + ([sched.chunked_req] if sched.chunked_req else [])
    forking = [fork for req in queued for fork in req.forks]
    live = queued + forking
    assert sorted(r.rid for r in live) == sorted(sched.reqs), "a request is lost or in two places"
    for req in sched.waiting:
        assert (
            req.status is ReqStatus.WAITING
            and req.req_pool_idx is None
            and not req.page_table
            and req.kv_len == 0
        )
        assert req.cache_node is None, f"rid {req.rid} waits holding a cache lock"
    for req in sched.running:
        prompt_only_ending = req.max_new_tokens == 0 and req.flight.final_scheduled  # its last row in flight
        drafted = sum(len(row.draft) for row in req.flight.rows)  # a verify row in flight: KV ahead
        decoding = req.kv_len - drafted == req.seq_len - 1 and bool(req.output_ids)
        assert req.status is ReqStatus.RUNNING and (decoding or prompt_only_ending), (
            f"rid {req.rid} running but not decoding"
        )
    if sched.chunked_req is not None:
        req = sched.chunked_req
        assert req.status is ReqStatus.CHUNKED and 0 < req.kv_len < req.seq_len
    for fork in forking:
        leader = fork.leader
        assert fork.status is ReqStatus.FORKING and leader is not None and fork in leader.forks
        assert fork.kv_len == 0 and not fork.output_ids and fork.cache_node is None
        admitted = leader.req_pool_idx is not None
        assert (fork.req_pool_idx is not None) == admitted, (
            f"rid {fork.rid}: a req_pool_idx before its leader's"
        )
        want = -(-fork.fork_tail_tokens // ps) if admitted else 0
        assert len(fork.page_table) == want, f"rid {fork.rid}: {len(fork.page_table)} own pages, not {want}"
    held = [r for r in queued if r.status is not ReqStatus.WAITING] + sched.in_flight_reqs()
    held += [fork for fork in forking if fork.req_pool_idx is not None]
    holders = list({id(r): r for r in held}.values())
    sched.kv.check_integrity(holders)
    req_pool_idx = [r.req_pool_idx for r in holders]
    assert None not in req_pool_idx and len(req_pool_idx) == len(set(req_pool_idx)), "req_pool_idx broken"
    assert len(req_pool_idx) + sched.kv.req_pool.num_free == sched.kv.req_pool.size, "req_pool_idx leaked"
    for req in holders:
        if req.status is ReqStatus.FORKING:
            continue
        assert len(req.page_table) == -(-req.kv_len // ps), f"rid {req.rid}: page table does not fit kv_len"
