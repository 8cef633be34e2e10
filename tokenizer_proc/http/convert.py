"""OpenAI request bodies -> the engine's GenerateRequest, and engine rejections -> OpenAI errors.

The engine's own validation (``tokenizer_proc.validation``) checks ranges and
tokenizes; this module only maps names, refuses what rivulet does not implement
(``suffix``) with a 400 naming the parameter (output constraints: constraints.py), and fills
OpenAI's defaults. A completions ``prompt`` that is a batch becomes one request per prompt, each with
the body's ``n`` choices (``best_of`` of them when best_of > n: the app keeps the n best).
"""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.chat import ContentPart, TextPart
from protocol.grammar import Grammar
from protocol.logprobs import MAX_TOP_LOGPROBS
from protocol.messages import ChatMessage, GenerateRequest, SamplingParams
from tokenizer_proc.http.chat_fields import check_accepted_fields, legacy_history, template_kwargs, tools_of
from tokenizer_proc.http.constraints import grammar_of
from tokenizer_proc.http.errors import ApiError, bad_param, shutting_down
from tokenizer_proc.http.image_parts import image_part
from tokenizer_proc.http.schemas import (
    ChatCompletionRequest,
    ChatMessageIn,
    CompletionRequest,
    SamplingFields,
)
from tokenizer_proc.http.schemas import ContentPart as ContentPartIn
from tokenizer_proc.images import IMAGE_TOO_LARGE
from tokenizer_proc.intake import SHUTTING_DOWN
from tokenizer_proc.validation import RequestRejected

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
UNTIL_CONTEXT = 2**31 - 1  # chat without a limit: the engine clamps this to the room left in the context
MAX_STOP_STRINGS = 16
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


def completion_requests(body: CompletionRequest, rid: str) -> list[GenerateRequest]:
    """One request per prompt of the batch (rid ``{rid}-{index}`` when there are several)."""
    if body.suffix is not None:
        raise bad_param("suffix", "suffix is not supported")
    best_of = choices_drawn(body)
    top = _top_logprobs("logprobs", body.logprobs or 0)
    max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
    if max_tokens == 0 and not body.echo:
        raise bad_param("max_tokens", "max_tokens must be >= 1 (0 only with echo=true)")
    req = GenerateRequest(
        rid=rid,
        sampling=_sampling(body, max_tokens, grammar_of(None, body.regex, body.ebnf)),
        stream=body.stream,
        logprobs=body.logprobs is not None or best_of > body.n,  # best_of ranks by them
        top_logprobs=top,
        echo=body.echo,
        n=best_of,
    )
    prompts = _prompts(body.prompt)
    return [
        msgspec.structs.replace(
            req, rid=rid if len(prompts) == 1 else f"{rid}-{i}", prompt=prompt, input_ids=input_ids
        )
        for i, (prompt, input_ids) in enumerate(prompts)
    ]


def choices_drawn(body: CompletionRequest) -> int:
    """How many choices each prompt draws: ``best_of`` (>= n; not streamed when > n), else n."""
    if body.best_of is None:
        return body.n
    if body.best_of < body.n:
        raise bad_param("best_of", f"best_of must be >= n ({body.n}), got {body.best_of}")
    if body.best_of > body.n and body.stream:
        raise bad_param("best_of", "best_of > n cannot be streamed")
    return body.best_of


def _top_logprobs(param: str, n: int) -> int:
    if not 0 <= n <= MAX_TOP_LOGPROBS:
        raise bad_param(param, f"{param} must be in [0, {MAX_TOP_LOGPROBS}], got {n}")
    return n


def chat_request(body: ChatCompletionRequest, rid: str) -> GenerateRequest:
    top = _top_logprobs("top_logprobs", body.top_logprobs or 0)
    if top and not body.logprobs:
        raise bad_param("top_logprobs", "top_logprobs needs logprobs=true")
    check_accepted_fields(body)
    tools, choice, one_call = tools_of(body)
    if choice is not None and choice != "none" and not tools:
        raise bad_param("tool_choice", "tool_choice needs tools")
    grammar = grammar_of(body.response_format, body.regex, body.ebnf)
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return GenerateRequest(
        rid=rid,
        messages=[_chat_message(i, m) for i, m in enumerate(legacy_history(body.messages))],
        sampling=_sampling(body, limit if limit is not None else UNTIL_CONTEXT, grammar),
        stream=body.stream,
        logprobs=body.logprobs,
        top_logprobs=top,
        tools=tools,
        tool_choice=choice if choice is not None else "auto",
        parallel_tool_calls=not one_call,
        chat_template_kwargs=template_kwargs(body),
        n=body.n,
    )


def _sglang_extensions(body: SamplingFields) -> None:
    """SGLang's extension fields (sglang-router adds them to what it forwards) at any value but
    what rivulet does: a 400 naming the field."""
    unsupported = {
        "no_stop_trim": body.no_stop_trim,
        "skip_special_tokens": not body.skip_special_tokens,
        "return_hidden_states": body.return_hidden_states,
    }
    if isinstance(body, ChatCompletionRequest):
        unsupported["continue_final_message"] = body.continue_final_message
    for name, asked in unsupported.items():
        if asked:
            raise bad_param(name, f"{name} is not supported at this value")


def _sampling(body: SamplingFields, max_tokens: int, grammar: Grammar | None) -> SamplingParams:
    _sglang_extensions(body)
    if body.stream_options is not None and not body.stream:
        raise bad_param("stream_options", "stream_options is only allowed with stream=true")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_param("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    defaults = SamplingParams()
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        top_k=defaults.top_k if body.top_k is None else body.top_k,
        top_p=defaults.top_p if body.top_p is None else body.top_p,
        min_p=defaults.min_p if body.min_p is None else body.min_p,
        seed=body.seed,
        stop=stop,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        grammar=grammar,
        **_penalties(body),
    )


def _penalties(body: SamplingFields) -> dict[str, Any]:
    """The penalty fields as SamplingParams names them; the engine checks their ranges."""
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.strip().lstrip("-").isdigit():
            raise bad_param("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
        bias[int(key)] = value
    fields: dict[str, Any] = dict(
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=bias,
        min_tokens=body.min_tokens,
    )
    if body.repetition_penalty is not None:
        fields["repetition_penalty"] = body.repetition_penalty
    return fields


def _prompts(prompt: str | list[str | int | list[int]]) -> list[tuple[str | None, list[int] | None]]:
    """(text, token ids) per prompt, exactly one of them set: ``prompt`` is a text, token ids,
    or a batch of texts or of token-id lists."""
    if isinstance(prompt, str):
        return [(prompt, None)]
    if not prompt:
        raise bad_param("prompt", "prompt must not be empty")
    if all(isinstance(p, int) for p in prompt):
        return [(None, [p for p in prompt if isinstance(p, int)])]
    if all(isinstance(p, str) for p in prompt):
        return [(p, None) for p in prompt if isinstance(p, str)]
    if all(isinstance(p, list) for p in prompt):
        return [(None, p) for p in prompt if isinstance(p, list)]
    raise bad_param("prompt", "a batch of prompts must be all strings or all token-id lists")


def _chat_message(i: int, m: ChatMessageIn) -> ChatMessage:
    if m.role not in CHAT_ROLES:
        raise bad_param(
            f"messages[{i}].role", f"unknown role {m.role!r}; expected one of {sorted(CHAT_ROLES)}"
        )
    content: str | None
    parts: list[ContentPart] | None = None
    if isinstance(m.content, list) and any(part.type == "image_url" for part in m.content):
        content, parts = (
            None,
            [_content_part(part, f"messages[{i}].content[{j}]") for j, part in enumerate(m.content)],
        )
    elif isinstance(m.content, list):
        if any(part.type != "text" or part.text is None for part in m.content):
            raise bad_param(f"messages[{i}].content", "only text and image_url content parts are supported")
        content = "".join(part.text or "" for part in m.content)
    elif m.content is None and not (m.role == "assistant" and m.tool_calls):
        raise bad_param(
            f"messages[{i}].content", "content may be null only on an assistant message with tool_calls"
        )
    else:
        content = m.content
    role = "system" if m.role == "developer" else m.role
    return ChatMessage(
        role=role,
        content=content,
        tool_calls=m.tool_calls,
        tool_call_id=m.tool_call_id,
        name=m.name,
        parts=parts,
        reasoning=m.reasoning_content if m.role == "assistant" else None,
    )


def _content_part(part: ContentPartIn, param: str) -> ContentPart:
    if part.type == "text" and part.text is not None:
        return TextPart(text=part.text)
    if part.type == "image_url" and part.image_url is not None:
        return image_part(part.image_url.url, f"{param}.image_url.url")
    raise bad_param(param, f"a {part.type!r} part needs its {part.type} field; expected text or image_url")


def rejection_error(
    exc: RequestRejected, *, chat: bool, max_param: str, grammar_param: str = "response_format"
) -> ApiError:
    """The engine's rejection with the field named as the OpenAI API spells it (``grammar_param``:
    the field the request's grammar came from)."""
    if exc.code == SHUTTING_DOWN:
        return shutting_down()
    param = exc.param
    if param is not None:
        param = param.removeprefix("sampling.")
        if param == "max_new_tokens":
            param = max_param
        elif param == "grammar":
            param = grammar_param
        elif param in ("prompt", "input_ids", "messages"):
            param = "messages" if chat else "prompt"
        elif param == "top_logprobs" and not chat:
            param = "logprobs"  # the legacy API's name for it
    message = f"{param} {exc.detail}" if param else exc.detail
    status = 413 if exc.code == IMAGE_TOO_LARGE else 400
    return ApiError(status, message, param=param, code=exc.code)  # code: e.g. context_length_exceeded
