"""``POST /v1/embeddings`` (OpenAI's Embeddings API) over the served generative model.

Each input is one engine request with ``embed`` set: a prompt-only request (max_new_tokens 0)
that the scheduler batches with everything else and the prefix cache may serve; its reply carries
the prompt's final-norm hidden states pooled as the model's config says and L2-normalized
(tokenizer_proc/pooling.py). ``input``: a string, strings, token ids or lists of token ids
(at most 2048, as OpenAI). ``encoding_format`` float or base64 (little-endian float32, as
OpenAI's). ``dimensions``: only a size the model was trained for (else 400).
"""

from __future__ import annotations

import base64
import struct
import uuid
from typing import TYPE_CHECKING, Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from protocol.messages import FinishReason, GenerateOutput, GenerateRequest, SamplingParams
from tokenizer_proc.http.choices import submit_all, whole_replies
from tokenizer_proc.http.convert import rejection_error
from tokenizer_proc.http.errors import ApiError, bad_param, engine_error
from tokenizer_proc.http.schemas import Body, Int64, decode_body
from tokenizer_proc.pooling import normalized
from tokenizer_proc.validation import RequestRejected

if TYPE_CHECKING:
    from tokenizer_proc.http.app import OpenAiApi

MAX_INPUTS = 2048  # OpenAI's limit on one request's inputs


class EmbeddingRequest(Body, kw_only=True):
    model: str | None = None
    input: str | list[str | Int64 | list[Int64]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None
    user: str | None = None


class EmbeddingsApi:
    """The /v1/embeddings route; the engine is reached through ``api``'s bridge."""

    def __init__(self, api: OpenAiApi) -> None:
        self.api = api

    async def create(self, request: Request) -> Response:
        body = decode_body(await self.api.read_body(request), EmbeddingRequest)
        self.api.check_model(body.model)
        self._check_dimensions(body.dimensions)
        rid = f"embd-{uuid.uuid4().hex}"
        reqs = [_embed_request(f"{rid}-{i}", prompt) for i, prompt in enumerate(_inputs(body.input))]
        try:
            handles = await submit_all(self.api.bridge, reqs)
        except RequestRejected as exc:
            raise _rejection(exc) from None
        replies = await whole_replies(handles, request.receive)
        data = [_datum(i, reply, body) for i, reply in enumerate(replies)]
        tokens = sum(reply.usage.prompt_tokens for reply in replies if reply.usage is not None)
        model = body.model or self.api.settings.served_model_name
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        payload = {"object": "list", "data": data, "model": model, "usage": usage}
        return Response(msgspec.json.encode(payload), media_type="application/json")

    def _check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None:
            return
        error = self.api.bridge.frontend.info.embedding.dimensions_error(dimensions)
        if error is not None:
            raise bad_param("dimensions", f"dimensions {error}")


def _inputs(value: str | list[str | int | list[int]]) -> list[str | list[int]]:
    """One prompt per input: a string, a list of token ids, or a list of either (not mixed)."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise bad_param("input", "input must not be empty")
    if all(isinstance(v, int) for v in value):
        return [[v for v in value if isinstance(v, int)]]
    if len(value) > MAX_INPUTS:
        raise bad_param("input", f"at most {MAX_INPUTS} inputs, got {len(value)}")
    if all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value):
        return [v for v in value if isinstance(v, str | list)]
    raise bad_param("input", "input must be a string, strings, token ids or lists of token ids")


def _rejection(exc: RequestRejected) -> ApiError:
    """The engine's rejection with the field named as this API spells it (the prompt is ``input``;
    a model that cannot embed is the ``model``'s fault)."""
    error = rejection_error(exc, chat=False, max_param="input")
    param = {"prompt": "input", "embed": "model"}.get(error.param or "", error.param)
    return ApiError(
        error.status, f"{param} {exc.detail}" if param else exc.detail, param=param, code=error.code
    )


def _embed_request(rid: str, prompt: str | list[int]) -> GenerateRequest:
    text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
    return GenerateRequest(
        rid=rid, prompt=text, input_ids=ids, sampling=SamplingParams(max_new_tokens=0), embed=True
    )


def _datum(index: int, reply: GenerateOutput, body: EmbeddingRequest) -> dict[str, Any]:
    if reply.finish_reason is FinishReason.ERROR or reply.embedding is None:
        raise engine_error(reply.error or "the engine returned no embedding")
    values = reply.embedding
    if body.dimensions is not None and body.dimensions < len(values):  # Matryoshka: cut, renormalize
        values = normalized(values[: body.dimensions])
    embedding: list[float] | str = values
    if body.encoding_format == "base64":
        embedding = base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
    return {"object": "embedding", "index": index, "embedding": embedding}
