"""The OpenAI Agents SDK (``openai-agents``) on both of its model classes against the tiny engine:
a function tool that runs, ``output_type`` beside tools with ``tool_choice="required"``, and the
``ModelSettings`` fields it sends as they are (``metadata``, ``store``, ``truncation``)."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import openai
import pytest
from agents import (
    Agent,
    FunctionTool,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

from tests.tokenizer_proc.http.clients.common import API_KEY, ASK, CITIES, MODEL, Sent, Verdict

ENDPOINTS = {"responses": "responses", "chat": "chat/completions"}


@pytest.fixture(autouse=True, scope="module")
def _no_tracing() -> None:
    set_tracing_disabled(True)  # the env switch in conftest.py covers the import, this the runs


def _lookup_tool(ran: list[str]) -> FunctionTool:
    """A tool that records its calls and leaves the agent once it has run: the turn after it then
    has only the output format to follow, whatever the tiny model would choose."""

    def lookup(city: Literal["paris", "rome"]) -> str:
        """The weather in a city."""
        ran.append(city)
        return "sunny"

    return function_tool(lookup, is_enabled=lambda _ctx, _agent: not ran)


async def _run(sent: Sent, api_kind: str, **agent_kw: Any) -> Any:
    async with openai.AsyncOpenAI(
        base_url=sent.v1, api_key=API_KEY, max_retries=0, http_client=sent.async_http_client()
    ) as client:
        model_class = OpenAIResponsesModel if api_kind == "responses" else OpenAIChatCompletionsModel
        agent = Agent(name="weather", instructions="Be brief.", model=model_class(MODEL, client), **agent_kw)
        return await Runner.run(agent, ASK, max_turns=4)


@pytest.mark.parametrize("api_kind", ["responses", "chat"])
def test_a_forced_function_tool_runs_and_ends_the_run(sent: Sent, api_kind: str) -> None:
    ran: list[str] = []
    settings = ModelSettings(tool_choice="required", temperature=0.0, max_tokens=40)
    agent_kw = {"tools": [_lookup_tool(ran)], "model_settings": settings}
    result = asyncio.run(_run(sent, api_kind, tool_use_behavior="stop_on_first_tool", **agent_kw))
    assert len(ran) == 1 and ran[0] in CITIES and result.final_output == "sunny"
    assert sent.to(ENDPOINTS[api_kind])[0]["tool_choice"] == "required"


@pytest.mark.parametrize("api_kind", ["responses", "chat"])
def test_output_type_with_a_required_tool_parses_after_the_tool_ran(sent: Sent, api_kind: str) -> None:
    """The first request forces a tool call and carries the output format (item 1 of issue 51);
    the second has the format alone."""
    ran: list[str] = []
    settings = ModelSettings(tool_choice="required", temperature=0.0, max_tokens=40)
    agent_kw = {"tools": [_lookup_tool(ran)], "model_settings": settings, "output_type": Verdict}
    result = asyncio.run(_run(sent, api_kind, **agent_kw))
    assert len(ran) == 1 and isinstance(result.final_output, Verdict)
    first = sent.to(ENDPOINTS[api_kind])[0]
    assert first["tool_choice"] == "required" and ("text" in first or "response_format" in first)


@pytest.mark.parametrize("api_kind", ["responses", "chat"])
def test_model_settings_metadata_store_truncation_are_accepted(sent: Sent, api_kind: str) -> None:
    """The output type only makes the reply end in budget (the SDK fails an incomplete response)."""
    metadata = {"suite": "clients"}
    settings = ModelSettings(metadata=metadata, store=True, truncation="auto", temperature=0.0, max_tokens=40)
    result = asyncio.run(_run(sent, api_kind, model_settings=settings, output_type=Verdict))
    assert isinstance(result.final_output, Verdict) and len(result.raw_responses) == 1
    body = sent.to(ENDPOINTS[api_kind])[0]
    assert body["metadata"] == metadata and body["store"] is True
    if api_kind == "responses":  # the chat-completions model has no truncation to send
        assert body["truncation"] == "auto"
