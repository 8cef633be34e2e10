"""The scheduler <-> worker channel: one ForwardBatch per step, one ForwardResult back (see
messages.py for every channel; these are re-exported there)."""

# mypy reads msgspec's dataclass_transform and takes a subclass that does not repeat
# frozen=True for non-frozen; msgspec inherits the base's frozen config, so that error is wrong here.
# mypy: disable-error-code="misc"

from __future__ import annotations

from protocol.base import Msg
from protocol.embedding import Pooling
from protocol.images import ImageInput
from protocol.logprobs import TopTokens
from protocol.sampling import WorkerSampling

PENDING = -1  # in ForwardBatch.input_ids: the token this row's request drew last (overlap scheduling)


class ForwardBatch(Msg):
    """One forward pass: extend rows (prefill chunks) and decode rows alike.

    Row ``i`` belongs to the request whose page-table row is ``req_pool_idx[i]`` (its
    req_pool_idx: the worker's per-request state is indexed by it too); its ``extend_lens[i]`` new
    tokens (``input_ids``, flattened over rows) sit at positions
    ``prefix_lens[i] .. prefix_lens[i] + extend_lens[i] - 1``. A decode row is
    an extend row of length 1.

    Page-table deltas: row ``i`` appends ``page_counts[i]`` pages (taken in order
    from the flat ``pages``) to its page-table row at index ``page_starts[i]``.
    A token at position p lives at the KV location (its row of the K/V pool; the backends' ``out_locs``)
    ``page_table[req_pool_idx[i]][p // page_size] * page_size + p % page_size``.

    ``sample[i]`` is False for a chunk that is not the end of its prompt: its KV
    is written but no token is drawn. ``sampler[i]`` is sent when a req_pool_idx
    is (re)assigned to a request and None afterwards; the worker keeps it per req_pool_idx.

    A row's last input may be ``PENDING``: the scheduler sent this batch before the
    previous one's result came back (overlap scheduling), and the worker, which
    runs batches in order, uses the token it drew last for that req_pool_idx.

    Prompt logprobs (empty lists when no row wants them): row ``i`` wants the logprobs at its
    first ``prompt_logprob_lens[i]`` positions, of the tokens that follow them, given flat in
    ``prompt_logprob_targets``.

    Pooling (empty when no row pools): ``pool[i]`` LAST asks for the final-norm hidden state of row
    ``i``'s last position, MEAN for the sum of those of its positions, None for nothing.

    Speculative decoding (empty when no row drafts): a verify row ``i`` (``draft_lens[i] > 0``, a
    sampling row whose inputs are all known) ends with ``draft_lens[i]`` drafted tokens after its
    request's last token. It draws a token at each of its last ``draft_lens[i] + 1`` positions, as
    a decode row would there, keeps the drafts up to the first that differs from its draw, and
    returns them and that draw (ForwardResult.num_tokens); the KV of the drafts it drops is void.
    """

    step: int
    req_pool_idx: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    input_ids: list[int]
    page_starts: list[int]
    page_counts: list[int]
    pages: list[int]
    sample: list[bool]
    sampler: list[WorkerSampling | None]
    prompt_logprob_lens: list[int] = []
    prompt_logprob_targets: list[int] = []
    # Per row (or [] when no row needs it): a row that (re)assigns the req_pool_idx of a request with
    # penalties and starts past 0 (a cached prefix) carries fill_ids[:prefix_len], the tokens the
    # worker's penalty counts need but never gets as inputs; every other row has [].
    prefix_ids: list[list[int]] = []
    # Forks (n > 1): fork j draws a token for req_pool_idx ``fork_req_pool_idx[j]``, with
    # ``fork_samplers[j]``, from the logits of row ``fork_rows[j]`` (a sampling row); the fork starts
    # with that row's penalty counts. After the forward, KV page ``copy_src[k]`` is copied to
    # ``copy_dst[k]``: a fork's own copy of a prompt page it cannot share (the partly filled last one).
    fork_rows: list[int] = []
    fork_req_pool_idx: list[int] = []
    fork_samplers: list[WorkerSampling] = []
    copy_src: list[int] = []
    copy_dst: list[int] = []
    # A hybrid model's recurrent-state checkpoints (scheduler_proc/state_checkpoints.py): before the
    # forward, row ``state_load_rows[k]``'s state becomes checkpoint ``state_load_ids[k]`` (a prefix
    # hit); after its first ``state_save_lens[k]`` tokens, row ``state_save_rows[k]``'s state is
    # copied to checkpoint ``state_save_ids[k]``.
    state_load_rows: list[int] = []
    state_load_ids: list[int] = []
    state_save_rows: list[int] = []
    state_save_lens: list[int] = []
    state_save_ids: list[int] = []
    pool: list[Pooling | None] = []
    draft_lens: list[int] = []
    # The images whose tokens some row extends over (empty when none): image k belongs to row
    # ``image_rows[k]``; the worker puts the vision tower's output for the row's positions among
    # the image's tokens in place of their embeddings (encoding each key once, cached).
    images: list[ImageInput] = []
    image_rows: list[int] = []
    # Per row, the sum of the ``rope_delta`` of its request's images ending at or before the row's
    # start (what its first token's position is off its index); empty when every row's is 0.
    rope_offsets: list[int] = []
    # Images of requests still waiting (none of this batch's ``images``), at most PREFETCH_IMAGES:
    # the worker encodes the ones it has not cached in the same tower calls as ``images`` and keeps
    # them for the batches that reach their tokens, so a step's tower runs over several images.
    prefetch_images: list[ImageInput] = []


# The most waiting requests' images a batch carries (ForwardBatch.prefetch_images); the worker
# keeps several times more encoded images, so one prefetched is still cached when its request runs.
PREFETCH_IMAGES = 8

ToWorker = ForwardBatch


class ForwardResult(Msg):
    """The tokens drawn for the rows of ``step`` whose ``sample`` was True, in row order, then for
    its forks in order (``token_ids``, ``logprobs`` and ``top_logprobs`` alike). A verify row gives
    ``num_tokens[k]`` of them (its taken drafts, then its draw); ``num_tokens`` is empty for a batch
    without drafts (one token a row).

    ``logprobs`` is empty when no row's request asked for logprobs (the worker skips
    computing them); so is ``top_logprobs`` when none asked for top-N. ``error`` is set
    (and the lists empty) when the forward failed; the scheduler
    then fails that batch's requests and keeps serving. ``busy_s`` is the worker's
    running total of seconds spent on batches (frame received to reply ready) and
    ``clock_s`` its monotonic clock as it replies: the two give the worker's busy
    share over any window from its own timestamps.
    """

    step: int
    token_ids: list[int]
    logprobs: list[float]
    forward_s: float
    error: str | None = None
    busy_s: float = 0.0
    clock_s: float = 0.0
    top_logprobs: list[TopTokens] = []  # per sampled row
    prompt_logprobs: list[float] = []  # per position of ForwardBatch.prompt_logprob_lens
    prompt_top_logprobs: list[TopTokens] = []  # the same, when their requests asked for top-N
    pooled: list[list[float]] = []  # per row with ForwardBatch.pool set, in row order
    num_tokens: list[int] = []  # per sampled row, when the batch has drafts


FromWorker = ForwardResult
