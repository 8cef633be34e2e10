"""Every message that crosses a process boundary in rivulet.

One ``msgspec.Struct`` per message and one tagged union per channel:

    client        -> tokenizer_proc : ClientRequest  = GenerateRequest | AbortRequest | FlushCacheRequest
    tokenizer_proc -> client        : ClientReply    = GenerateOutput
    tokenizer_proc -> scheduler_proc: ToScheduler    = TokenizedRequest | FinishReq | FlushPrefixCache
    scheduler_proc -> tokenizer_proc: ToTokenizer    = TokenBatch | RequestError | EngineStats
    scheduler_proc -> gpu_worker    : ToWorker       = ForwardBatch
    gpu_worker    -> scheduler_proc : FromWorker     = ForwardResult
    every child   -> launcher       : ToLauncher     = Ready | WorkerReady

Client messages are msgpack maps with unknown fields forbidden, so a client that
misspells a field gets an error instead of a silently ignored option. Messages
between our own processes are msgpack arrays (``array_like``): smaller and faster,
and both ends are always the same version of this file.

Only plain data travels: ints, floats, strings, ``list[int]``, enums. No tensors,
no pickles, no config objects.
"""

# mypy reads msgspec's dataclass_transform and takes a subclass that does not repeat
# frozen=True for non-frozen; msgspec inherits the base's frozen config, so that error is wrong here.
# mypy: disable-error-code="misc"

from __future__ import annotations

import enum
from typing import Any

import msgspec

from protocol.base import Msg
from protocol.chat import ChatMessage, Tool, ToolCallDelta, ToolChoice
from protocol.embedding import Pooling, PromptEmbedding
from protocol.grammar import Grammar
from protocol.images import ImageInput
from protocol.logprobs import PromptLogprobs, TopLogprobs, TopTokens
from protocol.sampling import WorkerSampling
from protocol.worker_messages import PENDING as PENDING  # re-exported: every channel is named here
from protocol.worker_messages import ForwardBatch as ForwardBatch
from protocol.worker_messages import ForwardResult as ForwardResult
from protocol.worker_messages import FromWorker as FromWorker
from protocol.worker_messages import ToWorker as ToWorker


class FinishReason(enum.Enum):
    """Why a request ended; every final reply carries one."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens or the model's context limit
    ABORT = "abort"  # the client (or shutdown) aborted it
    ERROR = "error"  # rejected or failed; GenerateOutput.error says why
    TOOL_CALLS = "tool_calls"  # a chat reply that calls tools (the tokenizer's, for a STOP)


# --------------------------------------------------------------------------
# client <-> tokenizer_proc (msgpack maps, unknown fields are an error)
# --------------------------------------------------------------------------


class ClientMsg(msgspec.Struct, tag=True, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of everything a client sends or receives."""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a client may ask of sampling and stopping.

    Checked by ``tokenizer_proc.validation``; defaults follow SGLang/OpenAI.
    ``top_k <= 0`` means no top-k; ``temperature == 0`` means greedy.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    # Penalties (see WorkerPenalties): presence and frequency as OpenAI defines them (over the
    # generated tokens), repetition as HF/vLLM/SGLang do (over prompt and output), logit_bias
    # (token id -> added logit), min_tokens (EOS and stop token ids masked until then).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    min_tokens: int = 0
    # Constrained decoding (see protocol/grammar.py); None: free text.
    grammar: Grammar | None = None


class GenerateRequest(ClientMsg, tag="generate"):
    """Exactly one of ``prompt``, ``messages`` (chat template applied) or ``input_ids``.

    ``top_logprobs`` (needs ``logprobs``): also the N most likely tokens at each position.
    ``echo`` (``prompt`` or ``input_ids`` only): the reply also carries the prompt, and with
    ``logprobs`` every prompt token's logprob, which bypasses the prefix cache (docs/http-api.md);
    ``max_new_tokens`` may then be 0.
    """

    rid: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    input_ids: list[int] | None = None
    sampling: SamplingParams = SamplingParams()
    stream: bool = False
    logprobs: bool = False
    cache_salt: str | None = None  # prefix-cache namespace: only requests with the same salt share KV
    top_logprobs: int = 0
    echo: bool = False
    # Chat only (docs/http-api.md): tools offered to the model and how it must use them, and extra
    # variables for the chat template (e.g. {"enable_thinking": false}).
    tools: list[Tool] | None = None
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True  # False: a reply keeps only its first tool call
    chat_template_kwargs: dict[str, Any] | None = None
    # n > 1: n choices drawn from one prefill of the prompt, choice i with seed + i (a seed is
    # drawn when none is given); every reply carries its choice's ``index``.
    n: int = 1
    # An embedding request (``prompt`` or ``input_ids``, max_new_tokens 0): nothing is generated;
    # the final reply's ``embedding`` is the prompt's final hidden states pooled as the model's
    # config says (protocol/embedding.py) and L2-normalized.
    embed: bool = False


class AbortRequest(ClientMsg, tag="abort"):
    rid: str


class FlushCacheRequest(ClientMsg, tag="flush_cache"):
    """Drop the engine's cached prefixes; answered by a GenerateOutput with ``rid`` and finish_reason STOP."""

    rid: str


ClientRequest = GenerateRequest | AbortRequest | FlushCacheRequest


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class GenerateOutput(ClientMsg, tag="output"):
    """One reply to a client: a delta when streaming, else the whole result.

    The last reply of a request has ``finish_reason`` and ``usage`` set; an error
    reply has ``finish_reason == ERROR`` and ``error`` set. ``rid`` is empty when
    the request could not even be parsed far enough to know it. A reply with an
    empty ``rid`` and no ``error`` is a liveness probe (the tokenizer learns that a
    client has gone when the probe cannot be delivered); clients ignore it.

    ``top_logprobs`` has one entry per token of ``token_ids`` when the request asked for them.
    The ``prompt_*`` fields (echo) come once: in a stream's first reply, else in the whole one;
    the prompt's logprobs and top-N have None for the first token, which nothing predicts.
    """

    rid: str
    text: str = ""
    token_ids: list[int] = []
    logprobs: list[float] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None
    top_logprobs: list[TopLogprobs] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[TopLogprobs | None] | None = None
    # Chat replies: the model's reasoning (text between think tags), split out of ``text``, and the
    # tool calls parsed out of it (pieces when streaming; see ToolCallDelta).
    reasoning_text: str = ""
    tool_calls: list[ToolCallDelta] | None = None
    index: int = 0  # the choice this reply belongs to (GenerateRequest.n)
    embedding: list[float] | None = None  # an embed request's vector, in its final reply


ClientReply = GenerateOutput


# --------------------------------------------------------------------------
# between our own processes (msgpack arrays)
# --------------------------------------------------------------------------


class TokenizedRequest(Msg):
    """A validated request, ready to schedule. ``rid`` is the tokenizer's internal id."""

    rid: int
    input_ids: list[int]
    max_new_tokens: int
    stop_token_ids: list[int]  # EOS ids (unless ignore_eos) plus the client's own
    sampler: WorkerSampling
    cache_salt: str | None = None  # the client's prefix-cache namespace
    # Every prompt token's logprob (echo): computed at every prompt position, so the prefix cache is
    # bypassed for this request; max_new_tokens may then be 0 (the request ends after its prompt).
    prompt_logprobs: bool = False
    # n > 1: the choices are requests rid .. rid + n - 1, choice i sampling with seed + i; the
    # prompt is prefilled once (as rid) and the others fork from its last position.
    n: int = 1
    # An embedding request (max_new_tokens 0): its prompt pooled so (protocol/embedding.py) comes
    # back in TokenBatch.embeddings, before the row that ends it.
    pooling: Pooling | None = None
    # The prompt's images (protocol/images.py), in prompt order, their token runs disjoint.
    images: list[ImageInput] = []


class FinishReq(Msg):
    """The tokenizer ends ``rid`` in the scheduler: ABORT (the client aborted or went away, or
    shutdown), STOP (the tokenizer matched one of the request's stop strings in its text)."""

    rid: int
    reason: FinishReason


class FlushPrefixCache(Msg):
    """A client's FlushCacheRequest, forwarded: drop every cached prefix no running request holds
    (the scheduler logs what it freed)."""


ToScheduler = TokenizedRequest | FinishReq | FlushPrefixCache


class TokenBatch(Msg):
    """One scheduler step's new tokens, one row per request that got a token.

    ``finished[i]`` is set on the row of a request's last token; a request that
    ends without a new token (aborted, or a prompt-only request done) appears with
    ``token_ids[i] == -1``. ``cached_tokens[i]`` counts the prompt tokens whose KV was reused.
    ``top_logprobs``: per row when some row asked for top-N (else empty).
    ``prompt_logprobs``: the prompts completed this step; they precede their requests' rows;
    so do ``embeddings``, the pooled prompts of embedding requests.
    """

    rids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finished: list[FinishReason | None]
    cached_tokens: list[int]
    top_logprobs: list[TopTokens] = []
    prompt_logprobs: list[PromptLogprobs] = []
    embeddings: list[PromptEmbedding] = []


class RequestError(Msg):
    """The scheduler rejected or failed ``rid``; it holds no state for it any more."""

    rid: int
    message: str


class EngineStats(Msg):
    """The scheduler's load, for /health and /metrics: sent with token batches at most every
    ~0.5 s, and once more when the engine goes idle with changed numbers (never on a timer).

    The first one also tells the tokenizer that the scheduler is up. ``evictable_pages`` are
    held only by a prefix cache and are reusable on demand; a leak-free idle engine has
    ``free_pages + evictable_pages == num_pages``.
    """

    num_running: int  # requests holding KV (decoding, or mid-prompt in chunks)
    num_waiting: int
    num_pages: int
    free_pages: int
    evictable_pages: int = 0
    # The worker's last ForwardResult counters: busy share over a window = d(busy) / d(clock).
    worker_busy_s: float = 0.0
    worker_clock_s: float = 0.0
    prefill_tokens: int = 0  # computed by prefill rows since start (cache hits and forks skip it)
    # Speculative decoding since start, as verify rows come back: drafts checked, kept, and the rows.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    verify_rows: int = 0
    replica: int = 0  # the data-parallel replica (--dp-size) whose scheduler sends it
    # The context the engine serves (WorkerReady's: the model's, bounded by the KV pool); 0: unknown.
    context_len: int = 0


ToTokenizer = TokenBatch | RequestError | EngineStats


class Ready(Msg):
    """A child process is up and serving."""

    proc: str
    pid: int
    http_port: int | None = None  # the tokenizer's: the port its HTTP API bound (--http-port 0: any free one)


class WorkerReady(Msg):
    """The worker loaded its model and allocated ``num_pages`` KV pages of ``page_size`` tokens."""

    pid: int
    num_pages: int
    page_size: int
    context_len: int
    device: str
    dtype: str
    replica: int = 0  # its data-parallel replica (--dp-size)
    tp_rank: int = 0  # its tensor-parallel rank (--tp-size)
    # Rank 0's, under --tp-size > 1: every rank's batch socket, by rank (ipc on the head node,
    # tcp on a worker node); the scheduler sends each batch to all of them.
    rank_endpoints: list[str] = []
    # A hybrid model's recurrent-state checkpoints (gpu_worker/recurrent_state.py): how many the
    # worker holds for the prefix cache; -1: the model keeps no recurrent state.
    state_checkpoints: int = -1


ToLauncher = Ready | WorkerReady
