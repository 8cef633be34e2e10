"""How the benchmarks reach an engine: rivulet's ZMQ client, or any OpenAI-compatible HTTP server.

Both turn one ``WorkItem`` into an async stream of ``Delta``s (tokens that arrived in one
chunk, plus the usage counters on the final one), so every peer is measured by the same code.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from bench.lib.workloads import WorkItem
from client import AsyncClient
from protocol.messages import FinishReason


class BackendError(RuntimeError):
    """The engine refused or failed a request; the message says why."""


@dataclass(frozen=True)
class Delta:
    """What one streamed chunk brought; ``finished`` marks the final one, which carries usage."""

    num_tokens: int
    finished: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class Backend(Protocol):
    """What the runner needs of a way to reach an engine."""

    name: str

    def stream(self, item: WorkItem) -> AsyncIterator[Delta]: ...

    async def close(self) -> None: ...


class ZmqBackend:
    """rivulet's own client; sends ``input_ids`` when the workload has exact tokens."""

    name = "zmq"

    def __init__(
        self,
        endpoint: str,
        temperature: float,
        stream: bool = True,
        timeout_s: float = 600,
        sampling: dict[str, Any] | None = None,
    ) -> None:
        self.client = AsyncClient(endpoint, timeout_s=timeout_s)
        self.temperature = temperature
        self.streaming = stream
        self.sampling = sampling or {}  # more generate() options on every request (penalties, ...)

    async def stream(self, item: WorkItem) -> AsyncIterator[Delta]:
        prompt = item.text if item.input_ids is None else None
        options: dict[str, Any] = dict(
            input_ids=item.input_ids, max_new_tokens=item.max_new_tokens,
            temperature=self.temperature, ignore_eos=item.ignore_eos, **self.sampling,
        )  # fmt: skip
        if not self.streaming:
            out = await self.client.generate(prompt, stream=False, **options)
            chunks: AsyncIterator[Any] = _one(out)
        else:
            chunks = await self.client.generate(prompt, stream=True, **options)
        async for chunk in chunks:  # EngineError (an ERROR reply) propagates to the runner
            if chunk.finish_reason is FinishReason.ABORT:
                raise BackendError("the engine aborted the request")
            usage = chunk.usage
            yield Delta(
                num_tokens=len(chunk.token_ids),
                finished=chunk.finish_reason is not None,
                prompt_tokens=usage.prompt_tokens if usage else 0,
                completion_tokens=usage.completion_tokens if usage else 0,
                cached_tokens=usage.cached_tokens if usage else 0,
            )

    async def close(self) -> None:
        await self.client.close()


async def _one(x: Any) -> AsyncIterator[Any]:
    yield x


class OpenAIBackend:
    """``POST {base_url}/v1/completions`` with ``stream: true``, read as server-sent events.

    A chunk with non-empty text counts as one token (OpenAI chunks do not say how many
    they carry), unless the chunk says how many the server has decoded (``decoded_count``);
    the final usage (``stream_options.include_usage``) gives the real count.
    """

    name = "openai"

    def __init__(
        self,
        base_url: str,
        model: str | None,
        temperature: float,
        timeout_s: float = 600,
        sampling: dict[str, Any] | None = None,
    ) -> None:
        self.http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s)
        self.model = model  # None: the first model GET /v1/models lists
        self.temperature = temperature
        self.sampling = sampling or {}  # more body fields on every request (penalties, ...)

    async def _served_model(self) -> str:
        if self.model is None:
            resp = await self.http.get("/v1/models")
            if resp.status_code != 200:
                raise BackendError(f"GET /v1/models: HTTP {resp.status_code}: {resp.text[:300]}")
            self.model = str(resp.json()["data"][0]["id"])
        return self.model

    def _body(self, item: WorkItem, model: str) -> dict[str, Any]:
        return {
            "model": model, "prompt": item.text, "max_tokens": item.max_new_tokens,
            "temperature": self.temperature, "stream": True, "ignore_eos": item.ignore_eos,
            "stream_options": {"include_usage": True}, **self.sampling,
        }  # fmt: skip

    async def stream(self, item: WorkItem) -> AsyncIterator[Delta]:
        request = self._body(item, await self._served_model())
        async with self.http.stream("POST", "/v1/completions", json=request) as resp:
            if resp.status_code != 200:
                answer = (await resp.aread()).decode(errors="replace")[:500]
                raise BackendError(f"HTTP {resp.status_code}: {answer}")
            finished = False
            decoded = 0  # the server's own count so far, where it reports one
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event names
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                delta, done = parse_event(event)
                if (n := decoded_count(event)) is not None:
                    delta = dataclasses.replace(delta, num_tokens=max(0, n - decoded))
                    decoded = max(decoded, n)
                finished = finished or done
                if delta.num_tokens or delta.completion_tokens:
                    yield delta
            if not finished:
                raise BackendError("the stream ended without a finish_reason")
            yield Delta(0, finished=True)

    async def close(self) -> None:
        await self.http.aclose()


def parse_event(event: dict[str, Any]) -> tuple[Delta, bool]:
    """One SSE event of /v1/completions -> (its tokens and usage, whether it had a finish_reason)."""
    if "error" in event:
        raise BackendError(f"server error: {event['error']}")
    choices = event.get("choices") or []
    text = (choices[0].get("text") or "") if choices else ""
    done = bool(choices and choices[0].get("finish_reason"))
    usage = event.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    delta = Delta(
        num_tokens=1 if text else 0,
        prompt_tokens=usage.get("prompt_tokens") or 0,
        completion_tokens=usage.get("completion_tokens") or 0,
        cached_tokens=details.get("cached_tokens") or 0,
    )
    return delta, done


def decoded_count(event: dict[str, Any]) -> int | None:
    """The tokens decoded so far where the event says (llama-server's ``timings.predicted_n`` with
    ``timings_per_token``), else None. A token whose text is empty (a random model's unused or
    control ids, which llama.cpp renders as nothing) still arrives in a chunk of its own: counted
    this way, it is timed where it came rather than not at all."""
    timings = event.get("timings")
    n = timings.get("predicted_n") if isinstance(timings, dict) else None
    return n if isinstance(n, int) else None
