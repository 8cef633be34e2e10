"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A response is one chat request to the engine (responses_input.py maps the body), answered whole
or as events (responses_stream.py); ``store`` (the default) keeps it in a bounded in-memory store
(responses_store.py) for ``previous_response_id``, GET and DELETE. What rivulet does not do
(built-in tools, background mode, conversations, ...) is a 400 naming the field.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from protocol.chat import ChatMessage
from protocol.messages import FinishReason, GenerateRequest
from tokenizer_proc.http.bridge import RequestHandle
from tokenizer_proc.http.choices import whole_replies
from tokenizer_proc.http.convert import rejection_error
from tokenizer_proc.http.errors import ApiError, engine_error
from tokenizer_proc.http.responses_input import generate_request, responses_param, without_oldest_item
from tokenizer_proc.http.responses_output import OutputItems, item_id
from tokenizer_proc.http.responses_run import ResponseRun, echo_fields
from tokenizer_proc.http.responses_schema import ResponsesRequest, unsupported_fields
from tokenizer_proc.http.responses_store import ResponseStore
from tokenizer_proc.http.responses_stream import ResponseEventStream
from tokenizer_proc.http.schemas import decode_body
from tokenizer_proc.validation import CONTEXT_LENGTH_EXCEEDED, RequestRejected

if TYPE_CHECKING:
    from tokenizer_proc.http.app import OpenAiApi


def _json(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status, media_type="application/json")


class ResponsesApi:
    """The /v1/responses routes; the engine is reached through ``api``'s bridge."""

    def __init__(self, api: OpenAiApi, store: ResponseStore) -> None:
        self.api = api
        self.store = store

    async def create(self, request: Request) -> Response:
        body = decode_body(await self.api.read_body(request), ResponsesRequest)
        self.api.check_model(body.model)
        unsupported_fields(body)
        history = self._history(body.previous_response_id)
        run_id = item_id("resp")
        instructions = 1 if body.instructions else 0
        req, handles = await self._submit(body, generate_request(body, run_id, history), instructions)
        assert req.messages is not None, "a Responses request is a chat request"
        run = ResponseRun(
            id=run_id,
            echo=echo_fields(body, body.model or self.api.settings.served_model_name),
            conversation=req.messages[instructions:],
            output=OutputItems(self.api.texts, logprobs=req.logprobs),
            store=self.store if body.store is not False else None,
            count_tokens=self._count_tokens,
        )
        if req.stream:
            return ResponseEventStream(handles[0], run)
        reply = (await whole_replies(handles, request.receive))[0]
        if reply.finish_reason is FinishReason.ERROR:
            raise engine_error(reply.error or "the engine failed the request")
        result, _ = run.finish(reply)
        return _json(result)

    async def _submit(
        self, body: ResponsesRequest, req: GenerateRequest, instructions: int
    ) -> tuple[GenerateRequest, list[RequestHandle]]:
        """Submit ``req``, and the request submitted. A max_output_tokens the client set that
        cannot fit beside the prompt is refused (context_length_exceeded), as chat and completions
        do; no limit is the rest of the context. ``truncation: "auto"``: while the input does not
        fit, its oldest item is dropped (the instructions stay), one at a time, as OpenAI does."""
        limit_set = body.max_output_tokens is not None
        while True:
            try:
                return req, await self.api.bridge.submit(req, clamp_to_context=not limit_set)
            except RequestRejected as exc:
                too_long = exc.code == CONTEXT_LENGTH_EXCEEDED and body.truncation == "auto"
                shorter = without_oldest_item(req, instructions) if too_long else None
                if shorter is None:
                    raise _rejection(exc) from None
                req = shorter

    async def retrieve(self, request: Request) -> Response:
        self.api.authorize(request)
        _no_query(request)
        return _json(self._stored(request).body)

    async def delete(self, request: Request) -> Response:
        self.api.authorize(request)
        _no_query(request)
        response_id = self._stored(request).body["id"]
        self.store.delete(response_id)
        return _json({"id": response_id, "object": "response.deleted", "deleted": True})

    def _stored(self, request: Request) -> Any:
        response_id = request.path_params["response_id"]
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id, None)
        return entry

    def _history(self, previous_id: str | None) -> list[ChatMessage]:
        if previous_id is None:
            return []
        entry = self.store.get(previous_id)
        if entry is None:
            raise _not_found(previous_id, "previous_response_id")
        return list(entry.conversation)

    def _count_tokens(self, text: str) -> int:
        return len(self.api.bridge.frontend.tokenizer.encode(text, add_special_tokens=False))


def _not_found(response_id: str, param: str | None) -> ApiError:
    message = (
        f"no response with id {response_id!r} (never stored, deleted, expired, "
        "or made before the server restarted)"
    )
    return ApiError(404, message, param=param, code="response_not_found")


def _no_query(request: Request) -> None:
    """GET and DELETE take no options: ``stream``, ``include`` and ``starting_after`` are refused."""
    for name in request.query_params:
        raise ApiError(
            400, f"the query parameter {name!r} is not supported", param=name, code="invalid_value"
        )


def _rejection(exc: RequestRejected) -> ApiError:
    """The engine's rejection, its field named as the Responses API spells it."""
    error = rejection_error(exc, chat=True, max_param="max_output_tokens", grammar_param="text.format")
    if error.param is not None and error.param != responses_param(error.param):
        param = responses_param(error.param)
        return ApiError(error.status, f"{param} {exc.detail}", param=param, code=error.code)
    return error
