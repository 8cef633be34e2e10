"""pydantic-ai (``pydantic-ai-slim[openai]``) on its chat and Responses models against the tiny
engine: a structured output beside a function tool (as an output tool, and as the native format
beside ``tool_choice: "auto"``), and ``ToolOrOutput``, which it sends as an ``allowed_tools``
tool_choice."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import openai
import pytest
from pydantic_ai import Agent, NativeOutput, RunContext, Tool, ToolDefinition, ToolOrOutput
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings
from pydantic_ai.usage import UsageLimits

from tests.tokenizer_proc.http.clients.common import API_KEY, ASK, CITIES, MODEL, Sent, Verdict

ENDPOINTS = {"responses": "responses", "chat": "chat/completions"}
SETTINGS: ModelSettings = {"temperature": 0.0, "max_tokens": 40}


def _tools(ran: list[str]) -> list[Tool[None]]:
    """``lookup``, which records its calls and is offered until it has run (so the step after it
    has only the output left, whatever the tiny model would choose), and ``forecast``, which no
    test lets the model call."""

    def lookup(city: Literal["paris", "rome"]) -> str:
        """The weather in a city now."""
        ran.append(city)
        return "sunny"

    def forecast(city: Literal["paris", "rome"]) -> str:
        """The weather in a city tomorrow."""
        ran.append(f"forecast {city}")
        return "rain"

    async def until_it_ran(_ctx: RunContext[None], tool_def: ToolDefinition) -> ToolDefinition | None:
        return None if ran else tool_def

    return [Tool(lookup, prepare=until_it_ran), Tool(forecast)]


async def _run(sent: Sent, api_kind: str, output_type: Any, settings: Any) -> Any:
    async with openai.AsyncOpenAI(
        base_url=sent.v1, api_key=API_KEY, max_retries=0, http_client=sent.async_http_client()
    ) as client:
        model_class = OpenAIResponsesModel if api_kind == "responses" else OpenAIChatModel
        model = model_class(MODEL, provider=OpenAIProvider(openai_client=client))
        ran: list[str] = []
        agent = Agent(model, output_type=output_type, tools=_tools(ran), model_settings=settings)
        result = await agent.run(ASK, usage_limits=UsageLimits(request_limit=4))
        return result.output, ran


def _first_step_forces_lookup(ctx: RunContext[None]) -> ModelSettings:
    return {**SETTINGS, "tool_choice": ["lookup"]} if ctx.run_step <= 1 else SETTINGS


@pytest.mark.parametrize("api_kind", ["chat", "responses"])
def test_output_tool_after_a_function_tool(sent: Sent, api_kind: str) -> None:
    output, ran = asyncio.run(_run(sent, api_kind, Verdict, _first_step_forces_lookup))
    assert isinstance(output, Verdict) and len(ran) == 1 and ran[0] in CITIES
    bodies = sent.to(ENDPOINTS[api_kind])
    assert len(bodies) == 2 and bodies[1]["tool_choice"] == "required"  # the output tool, now alone


@pytest.mark.parametrize("api_kind", ["chat", "responses"])
def test_native_output_beside_a_tool_on_auto(sent: Sent, api_kind: str) -> None:
    """A format with tools on ``tool_choice: "auto"`` (item 6 of issue 51): the model may call the
    tool or answer in the format, and either way the run ends parsed."""
    output, ran = asyncio.run(_run(sent, api_kind, NativeOutput(Verdict), SETTINGS))
    assert isinstance(output, Verdict) and all(city in CITIES for city in ran)
    first = sent.to(ENDPOINTS[api_kind])[0]
    assert first["tool_choice"] == "auto" and ("text" in first or "response_format" in first)


@pytest.mark.parametrize("api_kind", ["chat", "responses"])
def test_tool_or_output_sends_allowed_tools(sent: Sent, api_kind: str) -> None:
    """``ToolOrOutput`` names ``lookup`` beside the output tool (item 2 of issue 51); ``forecast``
    stays declared but outside the allowed set, so it never runs."""
    settings = {**SETTINGS, "tool_choice": ToolOrOutput(function_tools=["lookup"])}
    output, ran = asyncio.run(_run(sent, api_kind, Verdict, settings))
    assert isinstance(output, Verdict) and all(city in CITIES for city in ran)
    first = sent.to(ENDPOINTS[api_kind])[0]
    assert first["tool_choice"]["type"] == "allowed_tools" and len(first["tools"]) == 3
