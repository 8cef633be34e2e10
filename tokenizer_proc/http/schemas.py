"""Request bodies of the OpenAI API as msgspec structs, and decoding that names the bad field.

Unknown fields are an error (a misspelt option must not be silently ignored);
OpenAI fields that rivulet does not implement are accepted only at their
neutral values (``convert.py`` checks them). Integers are bounded to 64 bits so
nothing downstream ever sees a number it cannot encode.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from protocol.chat import FunctionCall, FunctionDef, NamedFunction, Tool, ToolCall, ToolChoice
from tokenizer_proc.http.errors import ApiError

Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
T = TypeVar("T")


class Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every request body."""


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(Body, kw_only=True):
    """Fields both endpoints share. ``top_k``, ``min_p``, ``stop_token_ids``, ``ignore_eos``,
    ``repetition_penalty`` and ``min_tokens`` are extensions (SGLang and vLLM accept them too)."""

    model: str | None = None
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    # Fields OpenAI marks nullable: null is the default (the property gives it).
    stream_sent: bool | None = msgspec.field(default=None, name="stream")
    stream_options: StreamOptions | None = None
    n_sent: Int64 | None = msgspec.field(default=None, name="n")
    presence_penalty_sent: float | None = msgspec.field(default=None, name="presence_penalty")
    frequency_penalty_sent: float | None = msgspec.field(default=None, name="frequency_penalty")
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    repetition_penalty: float | None = None  # extension (vLLM, SGLang): > 0, 1 is off
    min_tokens: Int64 = 0  # extension (vLLM): EOS and stop token ids are masked until then
    # SGLang's extensions, which sglang-router adds to every request it forwards: accepted at
    # what rivulet does (convert.py refuses the other values).
    no_stop_trim: bool = False  # a stop string is trimmed from the text
    skip_special_tokens: bool = True  # special tokens are left out of the text
    return_hidden_states: bool = False
    regex: str | None = None  # extension (SGLang): the output matches this regular expression
    ebnf: str | None = None  # extension (SGLang): the output follows this grammar (start rule ``root``)

    @property
    def stream(self) -> bool:
        return bool(self.stream_sent)

    @property
    def n(self) -> int:
        return 1 if self.n_sent is None else self.n_sent

    @property
    def presence_penalty(self) -> float:
        return self.presence_penalty_sent or 0.0

    @property
    def frequency_penalty(self) -> float:
        return self.frequency_penalty_sent or 0.0


class CompletionRequest(SamplingFields, kw_only=True):
    """``POST /v1/completions``: ``prompt`` is a string, or token ids, or a batch of either."""

    prompt: str | list[str | Int64 | list[Int64]]
    logprobs: Int64 | None = None  # legacy API: the chosen token's logprob and the N (<= 20) likeliest
    echo_sent: bool | None = msgspec.field(default=None, name="echo")  # null: false
    suffix: str | None = None
    best_of: Int64 | None = None

    @property
    def echo(self) -> bool:
        return bool(self.echo_sent)


class ImageUrl(Body):
    url: str
    detail: str | None = None  # accepted; the model's processor decides the resolution


class ContentPart(Body):
    type: str
    text: str | None = None
    image_url: ImageUrl | None = None


class ChatMessageIn(Body):
    """A message of the history. ``refusal``, ``reasoning_content`` and ``annotations`` are accepted
    (a client may send back an assistant message as it got it) and not shown to the model, but for
    an assistant's ``reasoning_content`` to a harmony model (convert.py, chat/template.py)."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None  # legacy: an assistant's one call (role "function" answers)
    tool_call_id: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None
    annotations: list[Any] | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessageIn]
    max_completion_tokens: Int64 | None = None
    logprobs_sent: bool | None = msgspec.field(default=None, name="logprobs")  # null: false
    top_logprobs: Int64 | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # None: OpenAI's default, "auto" ("none" without tools)
    parallel_tool_calls: bool | None = None
    continue_final_message: bool = False  # SGLang's extensions, as for SamplingFields
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM, SGLang): template variables
    reasoning_effort: str | None = None  # the template variable reasoning_effort (convert.py)
    # OpenAI's legacy spelling of tools / tool_choice, mapped to them (convert.py)
    functions: list[FunctionDef] | None = None
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    # Accepted without effect here, some at their neutral value only (convert.py); service_tier and
    # metadata are echoed as OpenAI echoes them.
    metadata: dict[str, str] | None = None
    store: bool | None = None  # no chat completion is stored: nothing can be retrieved later
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # rivulet's prefix cache finds shared prefixes itself
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = None
    verbosity: str | None = None
    modalities: list[str] | None = None

    @property
    def logprobs(self) -> bool:
        return bool(self.logprobs_sent)


_PATH = re.compile(r" - at `\$\.?(.*)`$")
_NAMED = re.compile(r"(?:unknown|required) field `([^`]*)`")


def decode_body(body: bytes, kind: type[T]) -> T:
    """Decode a JSON request body; raise a 400 ApiError whose ``param`` names the bad field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not valid UTF-8", code="invalid_json") from None
    except msgspec.ValidationError as exc:
        raise ApiError(
            400, f"invalid request: {exc}", param=invalid_field(exc), code="invalid_type"
        ) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # msgspec's, past its depth limit (in a field of any JSON)
        raise ApiError(400, "the request body is nested too deeply", code="invalid_json") from None


def invalid_field(exc: msgspec.ValidationError, prefix: str = "") -> str | None:
    """The field a msgspec validation error is about, under ``prefix``: ``messages[0].bar`` for a
    nested unknown field."""
    message = str(exc)
    path, named = _PATH.search(message), _NAMED.search(message)
    parts = [prefix, path.group(1) if path else "", named.group(1) if named else ""]
    return ".".join(p for p in parts if p).replace(".[", "[") or None
