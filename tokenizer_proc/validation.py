"""Check a client's GenerateRequest and turn it into token ids and sampler settings.

Every rejection raises ``RequestRejected`` with a message that names the
offending field, so the client learns exactly what to fix.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from protocol.embedding import Pooling
from protocol.images import ImageInput
from protocol.logprobs import MAX_TOP_LOGPROBS
from protocol.messages import GenerateRequest, SamplingParams
from protocol.sampling import WorkerGrammar, WorkerSampling
from tokenizer_proc.chat.template import ChatOutputPlan, ChatTemplateTraits, render_chat, template_traits
from tokenizer_proc.chat.tool_checks import forces_call
from tokenizer_proc.grammar import CompiledSpec
from tokenizer_proc.images import image_parts
from tokenizer_proc.model_info import ModelInfo
from tokenizer_proc.penalties import penalty_error, worker_penalties
from tokenizer_proc.validation_error import RequestRejected as RequestRejected

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SEED_LIMIT = 2**63  # seeds travel as signed 64-bit ints
# The worker scales float32 logits by 1/temperature: below GREEDY_BELOW a temperature is greedy (the
# scaled logits would overflow, and the draw is the argmax anyway), above MAX_TEMPERATURE refused.
GREEDY_BELOW = 1e-5
MAX_TEMPERATURE = 1e6


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
MAX_CHOICES = 128  # n: OpenAI's limit


@dataclass(frozen=True)
class ValidRequest:
    """A request that passed validation: what the scheduler and the detokenizer need."""

    client_rid: str
    input_ids: list[int]
    max_new_tokens: int  # already clamped so prompt + output fit the context
    stop_token_ids: list[int]  # EOS ids (unless ignore_eos) + the client's
    stop: tuple[str, ...]
    sampler: WorkerSampling
    stream: bool
    logprobs: bool
    cache_salt: str | None = None  # prefix-cache namespace
    top_logprobs: int = 0
    echo_text: str | None = None  # echo: the prompt as the reply gives it back (None: no echo)
    chat_output: ChatOutputPlan | None = None  # chat: how the reply is parsed (tools, reasoning)
    n: int = 1  # choices, forking from one prefill (choice i samples with seed + i)
    pooling: Pooling | None = None  # an embedding request: its prompt pooled so, nothing generated
    images: list[ImageInput] = field(default_factory=list)  # the prompt's images (tokenizer_proc/images.py)

    def __post_init__(self) -> None:
        min_new = 0 if self.echo_text is not None or self.pooling is not None else 1
        assert self.input_ids and self.max_new_tokens >= min_new, "validation let through an empty request"

    @property
    def prompt_logprobs(self) -> bool:
        return self.echo_text is not None and self.logprobs


def validate_generate(
    req: GenerateRequest,
    tokenizer: PreTrainedTokenizerBase,
    info: ModelInfo,
    rng: random.Random,
    grammar: CompiledSpec | None = None,
    *,
    traits: ChatTemplateTraits | None = None,
    clamp_to_context: bool = True,
) -> ValidRequest:
    """Validate ``req``, tokenize its prompt, clamp its output length; raise RequestRejected.

    ``req``: a forced tool call's grammar in it already (intake.py puts it there).
    ``grammar``: the request's grammar compiled (tokenizer_proc/grammar.py), when it has one.
    ``traits``: the chat template's, probed once by the caller (probed here when not given).
    ``clamp_to_context``: a ``max_new_tokens`` beyond the room the prompt leaves in the context is
    lowered to it (ZMQ clients, an HTTP request that set no limit); False: refused, as OpenAI and vLLM
    refuse a limit the client set (context_length_exceeded)."""
    if not req.rid:
        raise RequestRejected("rid", "must be a non-empty string")
    _check_chat_only(req)
    _check_sampling_of(req, info)
    params = req.sampling
    _check_logprob_options(req)
    _check_embed(req, info)
    _check_choices(req)
    input_ids, chat_output, images = _prompt_ids(req, tokenizer, info, traits)
    assert not forces_call(req) or params.grammar is not None, "a forced tool call comes with its grammar"
    if len(input_ids) >= info.context_len:
        raise RequestRejected(
            "prompt",
            f"is {len(input_ids)} tokens, the context length is {info.context_len}: "
            "no room for any output token",
            CONTEXT_LENGTH_EXCEEDED,
        )
    room = info.context_len - len(input_ids)
    if not clamp_to_context and params.max_new_tokens > room:
        raise RequestRejected(
            "sampling.max_new_tokens",
            f"is {params.max_new_tokens}: {len(input_ids)} prompt tokens + {params.max_new_tokens} = "
            f"{len(input_ids) + params.max_new_tokens}, over the context length {info.context_len}",
            CONTEXT_LENGTH_EXCEEDED,
        )
    stop_token_ids = [] if params.ignore_eos else list(info.eos_token_ids)
    stop_token_ids += [t for t in params.stop_token_ids if t not in stop_token_ids]
    # Drawn only once the request is accepted, so rejected requests do not shift later seeds.
    seed = params.seed if params.seed is not None else rng.randrange(SEED_LIMIT)
    sampler = WorkerSampling(
        temperature=float(params.temperature) if params.temperature >= GREEDY_BELOW else 0.0,
        top_k=min(params.top_k, info.vocab_size),  # any larger top_k keeps the whole vocabulary
        top_p=float(params.top_p),
        min_p=float(params.min_p),
        seed=seed,
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs,
        penalties=worker_penalties(params, len(input_ids), stop_token_ids),
        grammar=_worker_grammar(req, grammar, info, len(input_ids)),
    )
    return ValidRequest(
        client_rid=req.rid,
        input_ids=input_ids,
        max_new_tokens=min(params.max_new_tokens, room),
        stop_token_ids=stop_token_ids,
        stop=tuple(params.stop),
        sampler=sampler,
        stream=req.stream,
        logprobs=req.logprobs,
        cache_salt=req.cache_salt,
        top_logprobs=req.top_logprobs,
        echo_text=_echo_text(req, input_ids, tokenizer),
        chat_output=chat_output,
        n=req.n,
        pooling=info.embedding.pooling if req.embed else None,
        images=images,
    )


def _check_sampling_of(req: GenerateRequest, info: ModelInfo) -> None:
    """``req``'s sampling checked; a fault of a forced tool call's grammar is tool_choice's."""
    try:
        _check_sampling(req.sampling, info, echo=req.echo or req.embed)  # both may generate nothing
    except RequestRejected as exc:
        if exc.param == "sampling.grammar" and forces_call(req):
            raise RequestRejected("tool_choice", f"(forced call) {exc.detail}") from None
        raise


def _check_chat_only(req: GenerateRequest) -> None:
    if req.messages is None:
        for name in ("tools", "chat_template_kwargs"):
            if getattr(req, name) is not None:
                raise RequestRejected(name, "works with messages only")


def _check_choices(req: GenerateRequest) -> None:
    if not 1 <= req.n <= MAX_CHOICES:
        raise RequestRejected("n", f"must be in [1, {MAX_CHOICES}], got {req.n}")
    if req.n > 1 and req.sampling.max_new_tokens < 1:
        raise RequestRejected(
            "sampling.max_new_tokens", f"must be >= 1 with n > 1, got {req.sampling.max_new_tokens}"
        )


def _check_embed(req: GenerateRequest, info: ModelInfo) -> None:
    """An embedding request pools a prompt (protocol/embedding.py) and generates nothing."""
    if not req.embed:
        return
    if info.embedding.pooling is None:
        raise RequestRejected("embed", f"is not available: {info.embedding.unsupported}")
    if req.sampling.max_new_tokens != 0:
        raise RequestRejected(
            "sampling.max_new_tokens", f"must be 0 with embed, got {req.sampling.max_new_tokens}"
        )
    others = {
        "messages": req.messages is not None,
        "echo": req.echo,
        "logprobs": req.logprobs,
        "n": req.n != 1,
        "sampling.grammar": req.sampling.grammar is not None,
    }
    for name, given in others.items():
        if given:
            raise RequestRejected(name, "cannot be combined with embed")


def _check_logprob_options(req: GenerateRequest) -> None:
    if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise RequestRejected("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}")
    if req.top_logprobs and not req.logprobs:
        raise RequestRejected("top_logprobs", "needs logprobs=true")
    if req.echo and req.messages is not None:
        raise RequestRejected("echo", "works with prompt or input_ids, not messages")


def _echo_text(req: GenerateRequest, input_ids: list[int], tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The prompt an echo gives back: the text as sent, or the token ids decoded."""
    if not req.echo:
        return None
    return req.prompt if req.prompt is not None else str(tokenizer.decode(input_ids))


def _check_sampling(params: SamplingParams, info: ModelInfo, *, echo: bool) -> None:
    min_new = 0 if echo else 1  # echo with max_new_tokens 0 only scores the prompt
    if params.max_new_tokens < min_new:
        raise RequestRejected("sampling.max_new_tokens", f"must be >= {min_new}, got {params.max_new_tokens}")
    if not 0 <= params.temperature <= MAX_TEMPERATURE:  # NaN fails both comparisons
        raise RequestRejected(
            "sampling.temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {params.temperature}"
        )
    if not 0 < params.top_p <= 1:
        raise RequestRejected("sampling.top_p", f"must be in (0, 1], got {params.top_p}")
    if not 0 <= params.min_p <= 1:
        raise RequestRejected("sampling.min_p", f"must be in [0, 1], got {params.min_p}")
    if params.top_k < -1:
        raise RequestRejected("sampling.top_k", f"must be >= 1, or -1 or 0 for no top-k; got {params.top_k}")
    if params.seed is not None and not 0 <= params.seed < SEED_LIMIT:
        raise RequestRejected("sampling.seed", f"must be in [0, 2**63), got {params.seed}")
    if any(not s for s in params.stop):
        raise RequestRejected("sampling.stop", "must not contain an empty string")
    bad = [t for t in params.stop_token_ids if not 0 <= t < info.vocab_size]
    if bad:
        raise RequestRejected(
            "sampling.stop_token_ids", f"{bad[:8]} are outside the vocabulary [0, {info.vocab_size})"
        )
    error = penalty_error(params, info)
    if error is not None:
        raise RequestRejected(*error)
    if params.grammar is not None and params.ignore_eos:
        raise RequestRejected("sampling.grammar", "cannot go with ignore_eos (a grammar ends at EOS)")
    if params.grammar is not None and not info.eos_token_ids:
        raise RequestRejected("sampling.grammar", "needs a model with an EOS token to end the grammar")
    if params.grammar is not None and params.min_tokens:
        raise RequestRejected("sampling.grammar", "cannot be combined with min_tokens (it holds back EOS)")


def _worker_grammar(
    req: GenerateRequest, grammar: CompiledSpec | None, info: ModelInfo, prompt_len: int
) -> WorkerGrammar | None:
    """The grammar as the worker takes it: its end allows the EOS ids, which end the request (the
    request's stop_token_ids hold them: ignore_eos is refused with a grammar)."""
    if req.sampling.grammar is None:
        return None
    assert grammar is not None, "a request with a grammar is validated with its grammar compiled"
    return grammar.for_request(list(info.eos_token_ids), prompt_len)


def _prompt_ids(
    req: GenerateRequest,
    tokenizer: PreTrainedTokenizerBase,
    info: ModelInfo,
    traits: ChatTemplateTraits | None,
) -> tuple[list[int], ChatOutputPlan | None, list[ImageInput]]:
    given = [name for name in ("prompt", "messages", "input_ids") if getattr(req, name) is not None]
    if len(given) != 1:
        raise RequestRejected(None, f"give exactly one of prompt, messages, input_ids; got {given or 'none'}")
    if req.input_ids is not None:
        if not req.input_ids:
            raise RequestRejected("input_ids", "must not be empty")
        bad = [t for t in req.input_ids if not 0 <= t < info.vocab_size]
        if bad:
            raise RequestRejected("input_ids", f"{bad[:8]} are outside the vocabulary [0, {info.vocab_size})")
        return list(req.input_ids), None, []
    plan: ChatOutputPlan | None = None
    images: list[ImageInput] = []
    if req.prompt is not None:
        if not req.prompt:
            raise RequestRejected("prompt", "must not be empty")
        ids = list(tokenizer.encode(req.prompt))
    else:
        ids, plan, images = _chat_ids(req, tokenizer, info, traits or template_traits(tokenizer))
    if not ids:
        raise RequestRejected("prompt", "tokenizes to no tokens")
    return ids, plan, images


def _chat_ids(
    req: GenerateRequest, tokenizer: PreTrainedTokenizerBase, info: ModelInfo, traits: ChatTemplateTraits
) -> tuple[list[int], ChatOutputPlan, list[ImageInput]]:
    assert req.messages is not None, "_chat_ids needs messages"
    if not req.messages:
        raise RequestRejected("messages", "must not be empty")
    parts = image_parts(req.messages)
    if parts and info.images is None:
        raise RequestRejected(parts[0][0], "is an image, and this model has no vision tower: send text only")
    try:
        text, plan = render_chat(req, tokenizer, traits)
    except RequestRejected:
        raise
    except Exception as exc:  # jinja templates raise arbitrary errors on bad conversations
        raise RequestRejected("messages", f"could not be rendered by the chat template: {exc}") from exc
    if parts and info.images is not None:
        ids, images = info.images.prompt(text, req.messages)
        return ids, plan, images
    # What apply_chat_template(tokenize=True) does: the template writes the special tokens itself.
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)], plan, []
