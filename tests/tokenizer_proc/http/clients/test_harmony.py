"""A harmony (gpt-oss-format) model behind the HTTP API, driven by the ``openai`` package and the
Agents SDK: reasoning_content, tool calls and content on chat completions, reasoning, function_call
and message items on /v1/responses (streamed and whole), multi-turn with tool results; in this
package so that no client library reaches beyond the loopback (conftest.py).

No gpt-oss tokenizer exists offline: the model is a tiny Llama with SmolLM2's vocabulary plus
harmony's markers and a gpt-oss-style template (harmony_style.py), scripted so that a grammar
decides what it writes (a client's ``ebnf``, or the grammar of a forced call) and that it writes
harmony's markers as the special tokens."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, cast

import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

from tests.tokenizer_proc.chat.harmony_style import save_harmony_model
from tests.tokenizer_proc.http.server import API_KEY, HttpEngine, http_engine
from tokenizer_proc.model_info import load_tokenizer

CITIES = ("paris", "rome")
LOOKUP: Any = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": list(CITIES)}},
                       "required": ["city"], "additionalProperties": False},
    },
}  # fmt: skip
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
ANALYSIS = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
FINAL = ANALYSIS + "<|channel|>final<|message|>It is sunny."
CALL = ANALYSIS + '<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>{"city": "paris"}'


def _ebnf(text: str) -> dict[str, Any]:
    return {"ebnf": "root ::= " + json.dumps(text)}


@pytest.fixture(scope="module")
def harmony_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gpu_worker.weights.model_files import resolve_model

    base = load_tokenizer(str(resolve_model(None)))
    return save_harmony_model(base, tmp_path_factory.mktemp("harmony-model"))


@pytest.fixture(scope="module")
def harmony_api(harmony_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpEngine]:
    tmp = tmp_path_factory.mktemp("harmony-http")
    with http_engine(harmony_dir, tmp, "--api-key", API_KEY, "--served-model-name", "tiny") as e:
        yield e


@pytest.fixture
def client(harmony_api: HttpEngine) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=harmony_api.v1, api_key=API_KEY, max_retries=0, timeout=60.0) as c:
        yield c


def _chat(client: openai.OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(model="tiny", messages=ASK, temperature=0.0, max_tokens=150, **kw)


def test_reasoning_then_an_answer(client: openai.OpenAI) -> None:
    reply = _chat(client, extra_body=_ebnf(FINAL))
    message = reply.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (
        "Need the weather.",
        "It is sunny.",
    )
    assert reply.choices[0].finish_reason == "stop" and not message.tool_calls
    chunks = list(_chat(client, extra_body=_ebnf(FINAL), stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [(d.model_extra or {}).get("reasoning_content") or "" for d in deltas]
    content = [d.content or "" for d in deltas]
    assert ("".join(reasoning), "".join(content)) == ("Need the weather.", "It is sunny.")
    first_content = next(i for i, c in enumerate(content) if c)
    assert not any(reasoning[first_content:]) and sum(1 for r in reasoning if r) > 1  # streamed, in order


def test_reasoning_then_a_tool_call_with_tools_offered_freely(client: openai.OpenAI) -> None:
    reply = _chat(client, tools=[LOOKUP], extra_body=_ebnf(CALL))
    choice = reply.choices[0]
    assert (
        choice.message.model_extra["reasoning_content"] == "Need the weather." and not choice.message.content
    )
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("lookup", {"city": "paris"})
    assert choice.finish_reason == "tool_calls" and call.id.startswith("call_")
    chunks = list(_chat(client, tools=[LOOKUP], extra_body=_ebnf(CALL), stream=True))
    pieces = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert pieces[0].function.name == "lookup" and pieces[0].id is not None
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "lookup"}}])
def test_a_forced_call(client: openai.OpenAI, choice: Any) -> None:
    reply = _chat(client, tools=[LOOKUP], tool_choice=choice, parallel_tool_calls=False)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "lookup" and json.loads(call.function.arguments)["city"] in CITIES
    assert reply.choices[0].finish_reason == "tool_calls"


def test_tool_results_are_rendered_back_in_harmony(client: openai.OpenAI, harmony_dir: Path) -> None:
    """Two parallel calls and their results: the prompt is the template's, one call a message."""
    calls = [
        {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": "lookup", "arguments": json.dumps({"city": c})},
        }
        for i, c in enumerate(CITIES)
    ]
    history: list[dict[str, Any]] = [*ASK, {"role": "assistant", "content": None, "tool_calls": calls},
               {"role": "tool", "tool_call_id": "call_1", "content": "rainy"},
               {"role": "tool", "tool_call_id": "call_0", "content": "sunny"}]  # fmt: skip
    reply = client.chat.completions.create(
        model="tiny", messages=cast(Any, history), tools=[LOOKUP], temperature=0.0, max_tokens=150,
        reasoning_effort="low", extra_body=_ebnf(FINAL),
    )  # fmt: skip
    assert reply.choices[0].message.content == "It is sunny."
    tok = load_tokenizer(str(harmony_dir))
    one_each = [*ASK, {**history[1], "tool_calls": [calls[0]]}, history[3],
                {**history[1], "tool_calls": [calls[1]]}, history[2]]  # fmt: skip
    prompt = tok.apply_chat_template(
        cast(Any, one_each),
        tools=[LOOKUP],
        add_generation_prompt=True,
        tokenize=False,
        reasoning_effort="low",
    )
    assert "Reasoning: low" in prompt
    assert reply.usage is not None and reply.usage.prompt_tokens == len(
        tok.encode(prompt, add_special_tokens=False)
    )


def test_responses_items_reasoning_then_a_function_call(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": "tiny", "input": ASK[0]["content"], "tool_choice": "required",
                          "tools": [{"type": "function", **LOOKUP["function"]}], "max_output_tokens": 150,
                          "reasoning": {"effort": "medium"}, "temperature": 0.0}  # fmt: skip
    response = client.responses.create(**kw)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "function_call"]
    call = response.output[1]
    assert call.name == "lookup" and json.loads(call.arguments)["city"] in CITIES
    events = list(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert "response.reasoning_text.delta" in types and "response.function_call_arguments.delta" in types
    assert types.index("response.reasoning_text.delta") < types.index(
        "response.function_call_arguments.delta"
    )
    done = events[-1]
    assert done.type == "response.completed"
    assert [i.type for i in done.response.output] == kinds
    assert done.response.output[1].arguments == call.arguments


def test_responses_message_item_from_a_format(client: openai.OpenAI) -> None:
    """A format's grammar makes the reply bare JSON from the first token: content, a message item."""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}  # fmt: skip
    response = client.responses.create(
        model="tiny", input="Sunny?", max_output_tokens=30, temperature=0.0,
        text={"format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert [item.type for item in response.output] == ["message"]
    assert json.loads(response.output_text)["answer"] in ("yes", "no")


@pytest.mark.parametrize("api_kind", ["responses", "chat"])
def test_agents_sdk_runs_a_tool_then_answers_in_its_format(harmony_api: HttpEngine, api_kind: str) -> None:
    """Turn one: a forced call (analysis first); the tool runs; turn two: the history with the call
    and its result rendered back in harmony, and an output format the reply follows."""
    from pydantic import BaseModel

    class Verdict(BaseModel):
        answer: Literal["yes", "no"]

    set_tracing_disabled(True)
    ran: list[str] = []

    def lookup(city: Literal["paris", "rome"]) -> str:
        """The weather in a city."""
        ran.append(city)
        return "sunny"

    async def run() -> Any:
        async with openai.AsyncOpenAI(base_url=harmony_api.v1, api_key=API_KEY, max_retries=0) as aclient:
            model_class = OpenAIResponsesModel if api_kind == "responses" else OpenAIChatCompletionsModel
            agent = Agent(
                name="weather", instructions="Be brief.", model=model_class("tiny", aclient),
                tools=[function_tool(lookup, is_enabled=lambda _ctx, _agent: not ran)],
                model_settings=ModelSettings(tool_choice="required", temperature=0.0, max_tokens=150),
                output_type=Verdict,
            )  # fmt: skip
            return await Runner.run(agent, ASK[0]["content"], max_turns=4)

    result = asyncio.run(run())
    assert len(ran) == 1 and ran[0] in CITIES and isinstance(result.final_output, Verdict)
