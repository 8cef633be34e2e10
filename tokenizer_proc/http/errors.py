"""OpenAI-shaped JSON errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

import msgspec
from starlette.responses import Response

from tokenizer_proc.intake import SHUTDOWN_MESSAGE, SHUTTING_DOWN

# OpenAI's error "type" by status class.
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable"}  # fmt: skip


class ApiError(Exception):
    """A request the HTTP API answers with an error; ``param`` names the offending field."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, object]:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(msgspec.json.encode(self.body()), self.status, media_type="application/json")


def bad_param(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def starting() -> ApiError:
    return ApiError(503, "the engine is starting; retry shortly", code="engine_starting")


def shutting_down() -> ApiError:
    return ApiError(503, SHUTDOWN_MESSAGE, code=SHUTTING_DOWN)


def engine_error(message: str) -> ApiError:
    """An error reply from the engine after admission, by what its message says went wrong."""
    if message == SHUTDOWN_MESSAGE:
        return shutting_down()
    if "context length" in message or "KV pool" in message:  # the scheduler's admission checks
        return ApiError(400, message, code="context_length_exceeded")
    return ApiError(500, message, code="engine_error")
