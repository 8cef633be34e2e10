"""What the sync and async clients share: the default endpoint, errors, request building."""

from __future__ import annotations

import os
import uuid

import msgspec

from protocol.messages import ChatMessage, FinishReason, GenerateOutput, GenerateRequest, SamplingParams

# Where the launcher binds the client socket unless told otherwise.
DEFAULT_ENDPOINT = "ipc:///tmp/rivulet/client.sock"
ENDPOINT_ENV = "RIVULET_ENDPOINT"


class EngineError(RuntimeError):
    """The engine rejected or failed a request; the message is the engine's reason."""


def default_endpoint() -> str:
    """``$RIVULET_ENDPOINT`` if set, else the launcher's default endpoint."""
    return os.environ.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT


def make_request(
    prompt: str | None,
    *,
    messages: list[dict[str, str]] | None,
    input_ids: list[int] | None,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    seed: int | None,
    stop: list[str] | None,
    stop_token_ids: list[int] | None,
    ignore_eos: bool,
    logprobs: bool,
    stream: bool,
    rid: str | None,
) -> GenerateRequest:
    """A GenerateRequest with a fresh rid unless one is given. The engine validates the values."""
    sampling = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        seed=seed,
        stop=list(stop or []),
        stop_token_ids=list(stop_token_ids or []),
        ignore_eos=ignore_eos,
    )
    chat = msgspec.convert(messages, list[ChatMessage]) if messages is not None else None
    return GenerateRequest(
        rid=rid if rid is not None else uuid.uuid4().hex,
        prompt=prompt,
        messages=chat,
        input_ids=input_ids,
        sampling=sampling,
        stream=stream,
        logprobs=logprobs,
    )


def check_reply(reply: GenerateOutput) -> GenerateOutput:
    """Raise EngineError for an error reply; pass any other reply through."""
    if reply.finish_reason is FinishReason.ERROR:
        raise EngineError(reply.error or "the engine failed the request without a reason")
    return reply
