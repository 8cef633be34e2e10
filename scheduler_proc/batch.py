"""A scheduled batch: its rows on the scheduler side, and the ForwardBatch the worker gets."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import msgspec

from protocol.embedding import Pooling
from protocol.images import ImageInput
from protocol.logprobs import TopTokens
from protocol.messages import ForwardBatch, ForwardResult
from protocol.sampling import WorkerSampling
from protocol.worker_messages import PREFETCH_IMAGES
from scheduler_proc.request import Req


@dataclass
class Row:
    """One request's part of a batch: extend ``extend_len`` tokens from position ``req.kv_len``."""

    req: Req
    extend_len: int
    sample: bool  # the row reaches the end of fill_ids: the worker draws the next token
    page_start: int  # index in the request's page-table row where new_pages go
    new_pages: list[int]
    new_req_pool_idx: bool  # its req_pool_idx was (re)assigned this round: the worker gets the sampler
    is_prefill: bool  # part of a prompt (or a recompute), not a decode step
    out_index: int = -1  # sampling rows: the index in output_ids of the token they draw (at launch)
    start: int = field(init=False)  # the request's kv_len when the row was built: its first position
    launched: bool = False  # applied to its request (Flight.launch): its batch was sent
    prompt_logprob_len: int = field(init=False)  # leading positions whose prompt logprobs it asks for
    forks: list[Req] = field(default_factory=list)  # choices whose first token this row's logits draw
    # A verify row's drafted tokens (speculative.py): its last len(draft) inputs, after the request's
    # last token; it samples at each of its last len(draft) + 1 positions.
    draft: list[int] = field(default_factory=list)
    pool: Pooling | None = field(init=False)  # what it asks of its final hidden states (embeddings)

    def __post_init__(self) -> None:
        assert self.extend_len >= 1, f"rid {self.req.rid}: empty row"
        assert self.req.req_pool_idx is not None, f"rid {self.req.rid}: row without a req_pool_idx"
        self.start = self.req.kv_len
        state = self.req.prompt_logprobs
        self.prompt_logprob_len = state.row_len(self.start, self.extend_len) if state is not None else 0
        embedding = self.req.embedding
        self.pool = embedding.row_pool(self.start, self.extend_len) if embedding is not None else None

    def images(self) -> list[ImageInput]:
        """The request's images with tokens among this row's positions (the worker puts their
        embeddings there)."""
        end = self.start + self.extend_len
        return [image for image in self.req.images if image.offset < end and self.start < image.end]

    def rope_offset(self) -> int:
        """How far this row's first position is off its index (ForwardBatch.rope_offsets)."""
        return sum(image.rope_delta for image in self.req.images if image.end <= self.start)

    def prompt_logprob_targets(self) -> list[int]:
        """The tokens that follow this row's prompt-logprob positions (prompt tokens, never PENDING)."""
        first = self.start + 1
        return self.req.input_ids[first : first + self.prompt_logprob_len]


@dataclass(frozen=True)
class BatchInfo:
    """What the log lines report about the last scheduled batch."""

    step: int
    num_prefill_rows: int
    num_prefill_tokens: int
    num_cached_tokens: int  # prefix-cache hits of the requests this batch admits
    num_decode_rows: int
    num_decoding: int  # running requests past prefill, in this batch or not

    @classmethod
    def of(cls, step: int, prefill: list[Row], decode: list[Row], num_decoding: int) -> BatchInfo:
        cached = sum(r.start for r in prefill if r.new_req_pool_idx)
        return cls(step, len(prefill), sum(r.extend_len for r in prefill), cached, len(decode), num_decoding)


class ImagePrefetch:
    """Which waiting requests' images ride along with a batch (ForwardBatch.prefetch_images).

    A prefill batch holds about one image's request, so the tower would see one image a call; a
    batch that brings an image never sent before (its tower runs anyway) also carries the next
    waiting requests' unsent images, and the worker encodes them all in one call. Keys sent
    lately are not sent again: their pixels are large, and the worker has them cached (one it
    dropped comes again with its own request's batch, only unbatched).
    """

    def __init__(self, limit: int = PREFETCH_IMAGES) -> None:
        self.limit = limit
        self.sent: OrderedDict[int, None] = OrderedDict()  # recent keys, oldest first

    def pick(self, rows: list[Row], waiting: Iterable[Req]) -> list[ImageInput]:
        own = [image.key for row in rows for image in row.images()]
        fresh = [key for key in own if key not in self.sent]
        for key in own:
            self._remember(key)
        if not fresh:
            return []
        picked: list[ImageInput] = []
        for req in waiting:
            for image in req.images:
                if len(picked) == self.limit:
                    return picked
                if image.key not in self.sent:
                    picked.append(image)
                    self._remember(image.key)
        return picked

    def _remember(self, key: int) -> None:
        self.sent[key] = None
        self.sent.move_to_end(key)
        while len(self.sent) > 4 * self.limit:
            self.sent.popitem(last=False)


def build_forward_batch(
    step: int, rows: list[Row], page_size: int, prefetch_images: list[ImageInput] | None = None
) -> ForwardBatch:
    """The wire form of ``rows``, built before they launch (``Flight.launch`` moves kv_len on).

    A decode row whose input token is still being drawn by a batch in flight sends
    ``PENDING`` (-1); the worker substitutes the token it drew last for that req_pool_idx.

    The per-row fields are built in one pass; the fields only some rows need (prompt logprobs,
    forks, drafts, pooling, images, penalty prefixes) are left empty without a pass of their own
    when no row of the batch has such a need, as for a step of plain decode rows (the scheduler
    builds one per step: docs/benchmarks-history.md, "The engine's own CPU at 32 streams, third").
    """
    req_pool_idx: list[int] = []
    prefix_lens: list[int] = []
    extend_lens: list[int] = []
    input_ids: list[int] = []
    page_starts: list[int] = []
    page_counts: list[int] = []
    pages: list[int] = []
    sample: list[bool] = []
    sampler: list[WorkerSampling | None] = []
    plain = True  # no row asks for more than the fields above
    for row in rows:
        req = row.req
        assert req.req_pool_idx is not None, f"rid {req.rid}: row without a req_pool_idx"
        assert not row.launched and row.start == req.kv_len, f"rid {req.rid}: built after launch"
        req_pool_idx.append(req.req_pool_idx)
        prefix_lens.append(row.start)
        extend_lens.append(row.extend_len)
        input_ids.extend(req.fill_slice(row.start, row.start + row.extend_len - len(row.draft)))
        if row.draft:
            input_ids.extend(row.draft)
        page_starts.append(row.page_start)
        page_counts.append(len(row.new_pages))
        pages.extend(row.new_pages)
        sample.append(row.sample)
        if row.new_req_pool_idx:
            sampler.append(req.sampler)
            plain = plain and not req.sampler.needs_prefix_ids
        else:
            sampler.append(None)
        if row.draft or row.forks or row.prompt_logprob_len or row.pool is not None or req.images:
            plain = False
    batch = ForwardBatch(
        step=step,
        req_pool_idx=req_pool_idx,
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
        input_ids=input_ids,
        page_starts=page_starts,
        page_counts=page_counts,
        pages=pages,
        sample=sample,
        sampler=sampler,
        prefetch_images=prefetch_images or [],
    )
    return batch if plain else _with_row_needs(batch, rows, page_size)


def _with_row_needs(batch: ForwardBatch, rows: list[Row], page_size: int) -> ForwardBatch:
    """``batch`` with the fields only some rows need: prompt logprobs, penalty prefixes, forks and
    their page copies, drafts, pooling, images and their rotary offsets."""
    prompt_logprobs = any(row.prompt_logprob_len for row in rows)
    images = [(i, image) for i, row in enumerate(rows) for image in row.images()]
    forks = [(i, fork) for i, row in enumerate(rows) for fork in row.forks]
    copies = [copy for row in rows if row.forks for copy in row.req.fork_copies(page_size)]
    return msgspec.structs.replace(
        batch,
        prompt_logprob_lens=[row.prompt_logprob_len for row in rows] if prompt_logprobs else [],
        prompt_logprob_targets=[t for row in rows for t in row.prompt_logprob_targets()]
        if prompt_logprobs
        else [],
        prefix_ids=state_prefix_ids(rows),
        fork_rows=[i for i, _ in forks],
        fork_req_pool_idx=[_req_pool_idx(fork) for _, fork in forks],
        fork_samplers=[fork.sampler for _, fork in forks],
        copy_src=[src for src, _ in copies],
        copy_dst=[dst for _, dst in copies],
        draft_lens=[len(row.draft) for row in rows] if any(row.draft for row in rows) else [],
        pool=[row.pool for row in rows] if any(row.pool is not None for row in rows) else [],
        images=[image for _, image in images],
        image_rows=[i for i, _ in images],
        rope_offsets=offsets if any(offsets := [row.rope_offset() for row in rows]) else [],
    )


def _req_pool_idx(req: Req) -> int:
    assert req.req_pool_idx is not None, f"rid {req.rid}: a fork without a req_pool_idx"
    return req.req_pool_idx


def state_prefix_ids(rows: list[Row]) -> list[list[int]]:
    """ForwardBatch.prefix_ids: the cached prefix of each row that gives a request with penalties or
    a grammar its req_pool_idx (the worker's counts and matchers follow only its inputs), [] for other rows;
    [] for none."""
    prefix_ids = [
        row.req.fill_slice(0, row.start) if row.new_req_pool_idx and row.req.sampler.needs_prefix_ids else []
        for row in rows
    ]
    return prefix_ids if any(prefix_ids) else []


_NO_PROMPT_LOGPROBS: tuple[list[float], list[TopTokens]] = ([], [])  # shared, never written to


@dataclass(frozen=True)
class RowResult:
    """What one row of a batch got back."""

    token: int | None  # None: the row samples nothing
    logprob: float = 0.0  # the token's, when its request asked (else 0.0)
    top: TopTokens | None = None  # the token's top-N alternatives, when its request asked
    prompt_logprobs: list[float] = field(default_factory=list)  # of its prompt_logprob_len positions
    prompt_top: list[TopTokens] = field(default_factory=list)  # their top-N, when its request asked
    forks: list[RowResult] = field(default_factory=list)  # the tokens drawn for its forks, in order
    more: list[RowResult] = field(default_factory=list)  # a verify row's tokens after ``token``, in order
    pooled: list[float] | None = None  # its pooled final hidden states, when it asked (Row.pool)


def row_results(rows: list[Row], result: ForwardResult) -> list[RowResult] | str:
    """Each row's share of ``result``, or why the result is a failure: the worker's error, or
    counts that do not match the batch."""
    num_rows = sum(row.sample for row in rows)
    num_sampled = num_rows + sum(len(row.forks) for row in rows)
    num_prompt = sum(row.prompt_logprob_len for row in rows)
    if result.error is not None:
        return result.error
    counts = _token_counts(rows, result)
    if isinstance(counts, str):
        return counts
    num_sampled += sum(counts) - num_rows  # a verify row's taken drafts
    if len(result.token_ids) != num_sampled:
        return f"worker returned {len(result.token_ids)} tokens for {num_sampled} sampled rows and forks"
    if result.top_logprobs and len(result.top_logprobs) != num_sampled:
        return f"worker returned {len(result.top_logprobs)} top-N lists for {num_sampled} draws"
    prompt_top = result.prompt_top_logprobs
    if len(result.prompt_logprobs) != num_prompt or (prompt_top and len(prompt_top) != num_prompt):
        return f"worker returned {len(result.prompt_logprobs)} prompt logprobs for {num_prompt} positions"
    num_pooled = sum(row.pool is not None for row in rows)
    if len(result.pooled) != num_pooled:
        return f"worker returned {len(result.pooled)} pooled vectors for {num_pooled} pooling rows"
    out: list[RowResult] = []
    k = p = 0
    sampled = iter(counts)
    for row in rows:
        end = p + row.prompt_logprob_len
        prompt = (result.prompt_logprobs[p:end], prompt_top[p:end]) if end > p else _NO_PROMPT_LOGPROBS
        p = end
        if not row.sample:
            out.append(RowResult(None, 0.0, None, *prompt))
            continue
        count = next(sampled)
        out.append(_drawn(result, k, prompt))
        out[-1].more.extend(_drawn(result, k + j, _NO_PROMPT_LOGPROBS) for j in range(1, count))
        k += count
    f = k  # the forks' draws follow the sampled rows', in row order
    pooled = iter(result.pooled)
    for i, (row, row_result) in enumerate(zip(rows, out, strict=True)):
        row_result.forks.extend(_drawn(result, f + j, _NO_PROMPT_LOGPROBS) for j in range(len(row.forks)))
        f += len(row.forks)
        if row.pool is not None:
            out[i] = replace(row_result, pooled=next(pooled))
    return out


def plain_logprobs(rows: list[Row], result: ForwardResult) -> list[float] | None:
    """The logprob of each row's token (0.0 where none was asked) when ``result`` is one token for
    each row and nothing more, and every row is a plain sampling row (no forks, drafts, prompt
    logprobs or pooling): the rows then take ``result.token_ids`` in order, with none of
    ``row_results``' splitting (a step of decode rows). None otherwise."""
    num_rows = len(rows)
    if (
        result.error is not None
        or len(result.token_ids) != num_rows
        or result.num_tokens
        or result.top_logprobs
        or result.prompt_logprobs
        or result.prompt_top_logprobs
        or result.pooled
    ):
        return None
    for row in rows:
        if not row.sample or row.forks or row.draft or row.prompt_logprob_len or row.pool is not None:
            return None
    if not result.logprobs:
        return [0.0] * num_rows
    return result.logprobs if len(result.logprobs) == num_rows else None


def _token_counts(rows: list[Row], result: ForwardResult) -> list[int] | str:
    """Tokens each sampling row returned (1, or a verify row's 1 + its taken drafts), or why the
    result's counts cannot be this batch's."""
    drafts = [len(row.draft) for row in rows if row.sample]
    if not result.num_tokens:
        return [1] * len(drafts) if not any(drafts) else "worker returned no token counts for verify rows"
    if len(result.num_tokens) != len(drafts):
        return f"worker returned {len(result.num_tokens)} token counts for {len(drafts)} sampled rows"
    if not all(1 <= n <= d + 1 for n, d in zip(result.num_tokens, drafts, strict=True)):
        return "worker returned more tokens for a row than it drafted, or none"
    return list(result.num_tokens)


def _drawn(result: ForwardResult, k: int, prompt: tuple[list[float], list[TopTokens]]) -> RowResult:
    """The RowResult of draw ``k`` of ``result`` (a sampled row's or a fork's)."""
    logprob = result.logprobs[k] if k < len(result.logprobs) else 0.0
    top = result.top_logprobs[k] if result.top_logprobs else None
    return RowResult(result.token_ids[k], logprob, top, *prompt)
