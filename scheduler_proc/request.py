"""One request's scheduling state: its tokens, its KV pages and where it stands."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from protocol.embedding import Pooling
from protocol.images import ImageInput
from protocol.messages import FinishReason, TokenizedRequest
from protocol.sampling import WorkerSampling
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.embedding import EmbeddingState
from scheduler_proc.flight import Flight
from scheduler_proc.page_allocator import pages_for
from scheduler_proc.prompt_logprobs import PromptLogprobState

if TYPE_CHECKING:
    from scheduler_proc.radix_cache import TreeNode
    from scheduler_proc.speculative import DraftState


class ReqStatus(enum.Enum):
    """Where a request stands.

    WAITING: in the waiting queue, no req_pool_idx, no pages, ``kv_len == 0``.
    CHUNKED: the one ``chunked_req``; holds a req_pool_idx and the pages of its first ``kv_len`` tokens.
    RUNNING: prefill done (or its last chunk is in flight); decodes one token per step.
    FINISHED: ended; its req_pool_idx and pages are free (or freed when its in-flight batch returns).
    FORKING: choice i > 0 of an n > 1 request, in its ``leader``'s ``forks`` and in no queue; from
        the leader's admission it holds a req_pool_idx and its own copies of the prompt pages it cannot
        share. Its first token is drawn from the leader's last prompt row; when that row
        returns it shares the leader's cached prompt pages and runs as any other request.
    """

    WAITING = "waiting"
    FORKING = "forking"
    CHUNKED = "chunked"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    """A request inside the scheduler.

    ``fill_ids`` (prompt + output so far) is what must eventually sit in the KV
    cache; ``kv_len`` of them already do or will once the batches sent to the
    worker have run (SGLang's ``len(prefix_indices)``), so a round extends
    ``fill_ids[kv_len:]``. ``computed_len <= kv_len`` counts the positions whose
    batches have returned: only those may enter the prefix cache. The last output
    token never has KV yet: it is the next decode step's input. A row that samples
    appends ``PENDING`` to ``output_ids`` when it is scheduled and the worker's
    token replaces it on the result; a batch scheduled in between (overlap) sends
    ``PENDING`` as input and the worker substitutes the token it just drew for
    that req_pool_idx (``Flight`` holds these lengths and the rows out). ``page_table``
    covers ``[0, len(page_table) * page_size)``, always at least ``[0, kv_len)``.
    """

    rid: int
    input_ids: list[int]
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    sampler: WorkerSampling
    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None  # its row of the worker's page table, while it holds one
    page_table: list[int] = field(default_factory=list)
    flight: Flight = field(default_factory=Flight)
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_retractions: int = 0
    num_overtaken: int = 0  # admission rounds in which a later arrival got in and this one did not
    cache_salt: str | None = None  # the prefix-cache namespace: requests share KV only within one
    # Prefix cache (see kv_manager.py): page_table[:num_tree_pages] belong to the tree, locked at cache_node.
    cache_node: TreeNode | None = None
    num_tree_pages: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the cache at the first admission
    prompt_logprobs: PromptLogprobState | None = None  # the client asked for them (echo)
    embedding: EmbeddingState | None = None  # an embedding request's pooled prompt
    draft: DraftState | None = None  # speculative decoding's lookup and pauses (speculative.py)
    # n > 1 (see ReqStatus.FORKING): the choices forking from this request's prompt, and for a
    # FORKING choice its leader and the prompt tokens its own pages hold (the rest it shares).
    forks: list[Req] = field(default_factory=list)
    leader: Req | None = None
    fork_tail_tokens: int = 0
    images: list[ImageInput] = field(default_factory=list)  # the prompt's images, in prompt order

    def __post_init__(self) -> None:
        assert len(self.input_ids) >= 1, f"rid {self.rid}: empty prompt"
        # 0: a prompt-only request (echo), which ends when its prompt is computed.
        assert self.max_new_tokens >= 0, f"rid {self.rid}: max_new_tokens must be >= 0"
        assert isinstance(self.stop_token_ids, frozenset), "stop_token_ids must be a frozenset"
        assert 0 <= self.kv_len <= self.seq_len, f"rid {self.rid}: kv_len {self.kv_len} out of range"
        assert self.status is ReqStatus.WAITING and self.req_pool_idx is None and not self.page_table, (
            f"rid {self.rid}: a new request starts waiting, without a req_pool_idx or pages"
        )

    @classmethod
    def from_msg(cls, msg: TokenizedRequest) -> Req:
        return cls(
            rid=msg.rid,
            input_ids=list(msg.input_ids),
            max_new_tokens=msg.max_new_tokens,
            stop_token_ids=frozenset(msg.stop_token_ids),
            sampler=msg.sampler,
            cache_salt=msg.cache_salt,
            prompt_logprobs=PromptLogprobState(len(msg.input_ids) - 1) if msg.prompt_logprobs else None,
            embedding=EmbeddingState(msg.pooling, len(msg.input_ids)) if msg.pooling is not None else None,
            images=list(msg.images),
        )

    def fork_pages(self, page_size: int, reserve: int) -> int:
        """Pages the choices forking from this request take: their own prompt pages, plus room for
        ``reserve`` output tokens each (0: the prompt pages alone, what admission allocates)."""
        return sum(pages_for(fork.fork_tail_tokens + reserve, page_size) for fork in self.forks)

    def fork_copies(self, page_size: int) -> Iterator[tuple[int, int]]:
        """(source page, its copy) for every prompt page a fork holds a copy of: the last ones of
        this request's prompt pages."""
        num_prompt_pages = pages_for(len(self.input_ids), page_size)
        for fork in self.forks:
            first = num_prompt_pages - len(fork.page_table)
            for k, page in enumerate(fork.page_table):
                yield self.page_table[first + k], page

    @property
    def needs_every_prompt_position(self) -> bool:
        """Prompt logprobs, or a MEAN-pooled embedding, are still to compute: no prefix-cache hit
        may skip a prompt position."""
        if self.embedding is not None and self.embedding.pooling is Pooling.MEAN and not self.embedding.done:
            return True
        return self.prompt_logprobs is not None and not self.prompt_logprobs.done

    @property
    def kv_len(self) -> int:
        """Positions whose KV is written or scheduled: the next row starts here."""
        return self.flight.kv_len

    @property
    def computed_len(self) -> int:
        """Positions whose KV is written (their batches returned)."""
        return self.flight.computed_len

    @property
    def seq_len(self) -> int:
        """len(fill_ids), without building the list."""
        return len(self.input_ids) + len(self.output_ids)

    @property
    def fill_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def extend_input_len(self) -> int:
        """Tokens of fill_ids whose KV is not computed yet."""
        return self.seq_len - self.kv_len

    @property
    def is_decoding(self) -> bool:
        """Only the last output token lacks KV: the next step is a 1-token decode."""
        return bool(self.output_ids) and self.kv_len == self.seq_len - 1

    def fill_slice(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end] without copying the whole sequence."""
        n = len(self.input_ids)
        head = self.input_ids[start:end] if start < n else []
        return head + self.output_ids[max(start - n, 0) : max(end - n, 0)]

    def key_slice(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end] as the prefix cache keys them: an image's tokens by its hash, so two
        prompts differing only in an image never share KV there."""
        ids = self.fill_slice(start, end)
        for image in self.images:
            lo, hi = max(image.offset, start), min(image.end, end)
            if lo < hi:
                ids[lo - start : hi - start] = [image.cache_key()] * (hi - lo)
        return ids

    def chunk_before_image(self, length: int) -> int:
        """A chunk of ``length`` tokens from kv_len, ended before an image it would cut (an image's
        tokens attend to each other: they are computed in one forward); unchanged where that would
        leave none (an image longer than the chunk budget is cut)."""
        start, end = self.kv_len, self.kv_len + length
        for image in self.images:
            if start < image.offset < end < image.end:
                return image.offset - start
        return length

    def reserve_tokens(self, clip_max_new_tokens: int) -> int:
        """Output tokens still to come, capped (SGLang's CLIP_MAX_NEW_TOKENS)."""
        return max(min(self.max_new_tokens - len(self.output_ids), clip_max_new_tokens), 0)

    def hits_length_limit(self, num_outputs: int, context_len: int) -> bool:
        """Whether ``num_outputs`` output tokens reach max_new_tokens or the context length."""
        return num_outputs >= self.max_new_tokens or len(self.input_ids) + num_outputs >= context_len

    def finish_reason_at(self, index: int, context_len: int) -> FinishReason | None:
        """Why the request ends with output token ``index``, if it does."""
        assert 0 <= index < len(self.output_ids), f"rid {self.rid}: no output token {index}"
        return self.finish_reason_of(self.output_ids[index], index, context_len)

    def finish_reason_of(self, token: int, index: int, context_len: int) -> FinishReason | None:
        """Why the request would end with ``token`` as its output token ``index``, if it would."""
        if token in self.stop_token_ids:
            return FinishReason.STOP
        if self.hits_length_limit(index + 1, context_len):
            return FinishReason.LENGTH
        return None

    def max_draft_tokens(self, context_len: int) -> int:
        """Drafts a verify row may carry now: with all of them taken and one more drawn, the
        request reaches neither max_new_tokens nor the context length beyond its limit."""
        limit = min(self.max_new_tokens, context_len - len(self.input_ids))
        return max(limit - len(self.output_ids) - 1, 0)

    @property
    def wants_draft(self) -> bool:
        """It drafts at its next decode step (speculative decoding on, and not paused)."""
        return self.draft is not None and self.draft.drafting


def fork_choices(leader: Req, n: int, page_size: int, *, share_prompt: bool) -> list[Req]:
    """Choices 1 .. n - 1 of an n > 1 request, FORKING from ``leader``: choice i is rid and seed
    ``leader``'s + i. With ``share_prompt`` (a prefix cache to share through) a choice copies only
    the partly filled last prompt page; without, every prompt page."""
    tail = len(leader.input_ids) % page_size if share_prompt else len(leader.input_ids)
    forks = []
    for i in range(1, n):
        fork = Req(
            rid=leader.rid + i,
            input_ids=list(leader.input_ids),
            max_new_tokens=leader.max_new_tokens,
            stop_token_ids=leader.stop_token_ids,
            sampler=msgspec.structs.replace(leader.sampler, seed=leader.sampler.seed + i),
            cache_salt=leader.cache_salt,
            images=leader.images,
        )
        fork.status, fork.leader, fork.fork_tail_tokens = ReqStatus.FORKING, leader, tail
        forks.append(fork)
    leader.forks = forks
    return forks


def why_rejected(msg: TokenizedRequest, config: SchedulerConfig, *, duplicate: bool) -> str | None:
    """Why ``msg`` could never run here, or None when it can.

    KV is counted in whole pages, as the pool hands it out. ``prompt + max_new_tokens``
    bounds what the request reserves when (re)admitted, even after a retraction
    (fill_ids plus the output still to come), so a request passing this check
    always fits an otherwise empty pool and can never deadlock the scheduler.
    """
    n, max_new = len(msg.input_ids), msg.max_new_tokens
    pool_tokens = config.total_tokens

    if duplicate:
        return f"duplicate request id {msg.rid}"
    if n == 0:
        return "empty prompt"
    if max_new < 0:
        return f"max_new_tokens must be >= 0, got {max_new}"
    if n + max_new > config.context_len:
        return (
            f"prompt ({n} tokens) + max_new_tokens ({max_new}) exceeds the context length "
            f"{config.context_len}"
        )
    if pages_for(n + 1, config.page_size) > config.num_pages:
        return f"prompt of {n} tokens does not fit the KV pool ({pool_tokens} tokens)"
    if pages_for(n + max_new, config.page_size) > config.num_pages:
        return (
            f"prompt ({n} tokens) + max_new_tokens ({max_new}) needs more KV than the whole pool "
            f"({pool_tokens} tokens)"
        )
    return _why_choices_rejected(msg, config) if msg.n != 1 else None


def _why_choices_rejected(msg: TokenizedRequest, config: SchedulerConfig) -> str | None:
    """Why an n > 1 request could never run: its choices are admitted together (one req_pool_idx each,
    the prompt's pages once and each choice's own pages), so together they must fit."""
    choices, n, max_new, ps = msg.n, len(msg.input_ids), msg.max_new_tokens, config.page_size
    if choices < 1:
        return f"n must be >= 1, got {choices}"
    if max_new == 0:
        return "n > 1 needs max_new_tokens >= 1"
    if choices > config.max_running_requests:
        return f"n = {choices} choices exceed max_running_requests ({config.max_running_requests})"
    tail = n % ps if config.prefix_cache else n
    pages = pages_for(n + max_new, ps) + (choices - 1) * pages_for(tail + max_new, ps)
    if pages > config.num_pages:
        return (
            f"n = {choices} choices of prompt ({n} tokens) + max_new_tokens ({max_new}) need more "
            f"KV than the whole pool ({config.total_tokens} tokens)"
        )
    return None
