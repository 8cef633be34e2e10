"""The ASGI app in-process (no engine): 503 until the scheduler reports, 503 while draining,
401 without the key, 413 for a huge body. Real Frontend and tokenizer, no sockets."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from gpu_worker.weights.model_files import resolve_model
from protocol.messages import EngineStats
from tokenizer_proc.frontend import Frontend
from tokenizer_proc.http.app import HttpSettings, build_app
from tokenizer_proc.http.bridge import HttpBridge
from tokenizer_proc.model_info import load_tokenizer, read_model_info
from tokenizer_proc.outbox import Outbox

BODY = {"prompt": "hi", "max_tokens": 2}
KEY = {"Authorization": "Bearer k"}


@pytest.fixture(scope="module")
def frontend_parts() -> tuple[object, object]:
    path: Path = resolve_model(None)
    tokenizer = load_tokenizer(str(path))
    return tokenizer, read_model_info(str(path), tokenizer)


def test_status_codes_follow_the_engine_state(frontend_parts: tuple[object, object]) -> None:
    tokenizer, info = frontend_parts
    frontend = Frontend(tokenizer, info, seed=0)  # type: ignore[arg-type]
    sent: list[Outbox] = []

    async def send(out: Outbox) -> None:
        sent.append(out)

    bridge = HttpBridge(frontend, send)
    app = build_app(bridge, HttpSettings("m", api_key="k", max_body_bytes=1000))

    async def scenario() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            codes = [(await c.get("/health")).status_code]
            codes.append((await c.post("/v1/completions", json=BODY, headers=KEY)).status_code)  # starting
            frontend.on_scheduler_msg(EngineStats(num_running=0, num_waiting=0, num_pages=4, free_pages=4))
            codes.append((await c.get("/health")).status_code)
            codes.append((await c.post("/v1/completions", json=BODY)).status_code)  # no key
            codes.append(
                (await c.post("/v1/completions", json={"prompt": "x" * 2000}, headers=KEY)).status_code
            )
            codes.append((await c.get("/v1/models", headers=KEY)).status_code)
            frontend.draining = True
            codes.append((await c.get("/health")).status_code)
            draining = await c.post("/v1/completions", json=BODY, headers=KEY)
            codes.append(draining.status_code)
            assert draining.json()["error"]["code"] == "shutting_down"
            return codes

    assert asyncio.run(scenario()) == [503, 503, 200, 401, 413, 200, 503, 503]
    assert sent == []  # nothing reached the scheduler


def test_a_bug_in_a_handler_is_a_500_and_leaves_nothing_behind(
    frontend_parts: tuple[object, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer, info = frontend_parts
    frontend = Frontend(tokenizer, info, seed=0)  # type: ignore[arg-type]
    frontend.on_scheduler_msg(EngineStats(num_running=0, num_waiting=0, num_pages=4, free_pages=4))
    sent: list[Outbox] = []

    async def send(out: Outbox) -> None:
        sent.append(out)

    def route_with_a_bug(*args: object) -> int:
        raise RuntimeError("a bug")

    app = build_app(HttpBridge(frontend, send), HttpSettings("m"))
    monkeypatch.setattr(frontend.router, "route", route_with_a_bug)  # after the request entered the table

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post("/v1/completions", json=BODY)

    reply = asyncio.run(post())
    assert reply.status_code == 500 and reply.json()["error"]["code"] == "internal_error", reply.text
    assert "a bug" in reply.json()["error"]["message"] and len(frontend.requests) == 0
