"""The Starlette app: OpenAI's completions, chat completions, responses, embeddings and models, plus
/health and /metrics."""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from protocol.messages import FinishReason, GenerateRequest
from tokenizer_proc.http.bridge import HttpBridge
from tokenizer_proc.http.chat_fields import reply_echo
from tokenizer_proc.http.choices import EventStream, submit_all, whole_replies, with_server_send
from tokenizer_proc.http.completion_bodies import ResponseShape, best_choices, total_usage
from tokenizer_proc.http.constraints import grammar_field
from tokenizer_proc.http.convert import chat_request, completion_requests, rejection_error
from tokenizer_proc.http.embeddings import EmbeddingsApi
from tokenizer_proc.http.errors import ApiError, engine_error, shutting_down, starting
from tokenizer_proc.http.responses_api import ResponsesApi
from tokenizer_proc.http.responses_store import DEFAULT_MAX_ENTRIES, DEFAULT_TTL_S, ResponseStore
from tokenizer_proc.http.schemas import ChatCompletionRequest, CompletionRequest, decode_body
from tokenizer_proc.metrics import render_prometheus, render_replicas
from tokenizer_proc.token_bytes import TokenTexts
from tokenizer_proc.validation import RequestRejected

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpSettings:
    """What the HTTP layer is told by the launcher."""

    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = 8 * 2**20
    responses_store_size: int = DEFAULT_MAX_ENTRIES  # stored /v1/responses responses (LRU)
    responses_store_ttl_s: float = DEFAULT_TTL_S


def json_response(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status, media_type="application/json")


class OpenAiApi:
    """The route handlers; every engine interaction goes through the bridge."""

    def __init__(self, bridge: HttpBridge, settings: HttpSettings) -> None:
        self.bridge = bridge
        self.settings = settings
        self.texts = TokenTexts(bridge.frontend.tokenizer)

    async def completions(self, request: Request) -> Response:
        body = decode_body(await self.read_body(request), CompletionRequest)
        self.check_model(body.model)
        rid = f"cmpl-{uuid.uuid4().hex}"
        return await self._generate(request, completion_requests(body, rid), body, rid=rid, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        body = decode_body(await self.read_body(request), ChatCompletionRequest)
        self.check_model(body.model)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        return await self._generate(request, [chat_request(body, rid)], body, rid=rid, chat=True)

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        card = {"id": self.settings.served_model_name, "object": "model", "created": 0,
                "owned_by": "rivulet", "max_model_len": self.bridge.frontend.info.context_len}  # fmt: skip
        return json_response({"object": "list", "data": [card]})

    async def model_info(self, request: Request) -> Response:
        """What a router in front of several servers (sglang-router) asks each for: the model id
        (open, as /health is)."""
        return json_response({"model_path": self.settings.served_model_name, "is_generation": True})

    async def server_info(self, request: Request) -> Response:
        frontend = self.bridge.frontend
        return json_response({"model_path": self.settings.served_model_name, "served_model_name":
                              self.settings.served_model_name, "dp_size": frontend.router.dp_size,
                              "max_model_len": frontend.info.context_len, "engine": "rivulet"})  # fmt: skip

    async def health(self, request: Request) -> Response:
        if not self.bridge.ready:
            return (shutting_down() if self.bridge.frontend.draining else starting()).response()
        return json_response({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        frontend = self.bridge.frontend
        text = render_prometheus(frontend.requests.metrics, frontend.engine_stats, len(frontend.requests))
        text += render_replicas(frontend.replica_stats, frontend.router.routed)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _generate(
        self, request: Request, reqs: list[GenerateRequest], body: Any, *, rid: str, chat: bool
    ) -> Response:
        """Run ``reqs`` (one per choice, all alike but for their prompt) as one response."""
        max_param = (
            "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
        )
        # A limit the client set that cannot fit beside the prompt is a 400 (OpenAI, vLLM); none set:
        # the default (completions 16, chat the rest of the context) is lowered to fit.
        limit_set = body.max_tokens is not None or (chat and body.max_completion_tokens is not None)
        try:
            handles = await submit_all(self.bridge, reqs, clamp_to_context=not limit_set)
        except RequestRejected as exc:
            raise rejection_error(
                exc, chat=chat, max_param=max_param, grammar_param=grammar_field(body)
            ) from None
        drawn = reqs[0].n  # choices per prompt: n, or best_of of which the n best are kept
        shape = ResponseShape(
            id=rid,
            model=body.model or self.settings.served_model_name,
            created=int(time.time()),
            chat=chat,
            logprobs=body.logprobs is not None if not chat else reqs[0].logprobs,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            texts=self.texts,
            choices_per_prompt=drawn,
            echo=reply_echo(body) if chat else {},
            legacy_functions=chat and bool(body.functions),
        )
        if reqs[0].stream:
            return EventStream(handles, shape)
        replies = await whole_replies(handles, request.receive)
        failed = [r for r in replies if r.finish_reason is FinishReason.ERROR]
        if failed:
            raise engine_error(failed[0].error or "the engine failed the request")
        usage = total_usage([r.usage for r in replies], drawn)
        if drawn > body.n:
            replies = best_choices(replies, drawn, body.n)
        return json_response(shape.whole(replies, usage))

    async def read_body(self, request: Request) -> bytes:
        """Authorize, check the engine is serving, and read the body within the size limit."""
        self.authorize(request)
        if not self.bridge.ready:
            raise shutting_down() if self.bridge.frontend.draining else starting()
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"the request body is over {limit} bytes", code="request_too_large")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"the request body is over {limit} bytes", code="request_too_large")
                chunks.append(chunk)
        except ClientDisconnect:  # nobody is left to read the answer
            raise ApiError(400, "the client went away before sending the whole body") from None
        return b"".join(chunks)

    def authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise ApiError(
                401, "missing or wrong API key (send 'Authorization: Bearer KEY')", code="invalid_api_key"
            )

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.served_model_name:
            message = (
                f"the model {model!r} does not exist; this server serves {self.settings.served_model_name!r}"
            )
            raise ApiError(404, message, param="model", code="model_not_found")


def build_app(bridge: HttpBridge, settings: HttpSettings) -> ASGIApp:
    api = OpenAiApi(bridge, settings)
    responses = ResponsesApi(
        api, ResponseStore(settings.responses_store_size, settings.responses_store_ttl_s)
    )
    routes = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/responses", responses.create, methods=["POST"]),
        Route("/v1/embeddings", EmbeddingsApi(api).create, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/model_info", api.model_info, methods=["GET"]),  # routers' worker discovery
        Route("/server_info", api.server_info, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
    ]
    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        ApiError: _api_error,
        HTTPException: _http_error,
        Exception: _internal_error,  # Starlette answers with it, logs the traceback, and serves on
    }
    return with_server_send(Starlette(routes=routes, exception_handlers=handlers))


def _answer(request: Request, error: ApiError) -> Response:
    """``error``'s response; a client's error (4xx) is logged at INFO, since uvicorn's access log
    is off and the operator must see why a client failed."""
    if 400 <= error.status < 500:
        logger.info(
            "%s %s -> %d %s (param %s): %s", request.method, request.url.path, error.status,
            error.code, error.param, error.message,
        )  # fmt: skip
    return error.response()


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError), f"routed {type(exc).__name__} to the ApiError handler"
    return _answer(request, exc)


async def _internal_error(request: Request, exc: Exception) -> Response:
    """A bug in a handler: OpenAI's error shape, 500 (the bridge has ended what the request left)."""
    return ApiError(500, f"internal error: {exc!r}", code="internal_error").response()


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 in OpenAI's shape."""
    assert isinstance(exc, HTTPException), f"routed {type(exc).__name__} to the HTTPException handler"
    return _answer(request, ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))
