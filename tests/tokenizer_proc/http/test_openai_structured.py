"""Structured output from the embedded SmolLM2, served for real, through the official ``openai``
package: ``parse`` with Pydantic models, regex-constrained completions, streamed JSON, bad
grammars as 400s naming their field, and the ZMQ client's ``grammar``."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from client import Client, EngineError, Grammar
from protocol.messages import GenerateOutput
from tests.tokenizer_proc.http.server import HttpEngine, http_engine

MODEL = "smol"
# Bounded strings and numbers: a 135M model may loop in digits or words where the schema allows it
# (the grammar keeps the output valid JSON, but parse raises on finish_reason length).
Short = Field(max_length=24)
Word = Annotated[str, Field(max_length=16)]
Small = Annotated[int, Field(ge=0, le=100)]


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class City(BaseModel):
    name: str = Short
    country: str = Short


class Person(BaseModel):
    name: str = Short
    age: Small


class Pet(BaseModel):
    name: str = Short
    species: Literal["cat", "dog", "fish"]


class Owner(BaseModel):
    name: str = Short
    pets: list[Pet] = Field(max_length=3)


class Weather(BaseModel):
    city: str = Short
    celsius: Small
    sunny: bool


class Answer(BaseModel):
    answer: Literal["yes", "no"]


class Paint(BaseModel):
    color: Color
    liters: Small


class Book(BaseModel):
    title: str = Short
    year: Annotated[int, Field(ge=1000, le=2030)]
    tags: list[Word] = Field(max_length=3)


class Point(BaseModel):
    x: Small
    y: Small


class Line(BaseModel):
    start: Point
    end: Point


class Trip(BaseModel):
    origin: City
    destination: City
    days: Small


class Score(BaseModel):
    team: str = Short
    points: Small
    won: bool


class Recipe(BaseModel):
    dish: str = Short
    ingredients: list[Word] = Field(max_length=4)


class Planet(BaseModel):
    name: Literal["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"]
    moons: Small


class Order(BaseModel):
    item: str = Short
    quantity: Small
    express: bool


class Grade(BaseModel):
    student: str = Short
    grade: Literal["A", "B", "C", "D", "F"]


class Numbers(BaseModel):
    values: list[Small] = Field(max_length=5)


class Sentiment(BaseModel):
    label: Literal["positive", "negative", "neutral"]


class Movie(BaseModel):
    title: str = Short
    director: Person


class Shape(BaseModel):
    kind: Literal["circle", "square", "triangle"]
    sides: Small


class Inventory(BaseModel):
    store: City
    items: list[Order] = Field(max_length=2)


CASES: list[tuple[str, type[BaseModel]]] = [
    ("What is the capital of France?", City),
    ("Invent a person.", Person),
    ("Describe someone who owns two pets.", Owner),
    ("What is the weather in Madrid?", Weather),
    ("Is the sky blue?", Answer),
    ("Pick a paint for a bedroom.", Paint),
    ("Name a famous book.", Book),
    ("Give a line segment.", Line),
    ("Plan a trip from Paris to Rome.", Trip),
    ("Report a football score.", Score),
    ("Give a simple pancake recipe.", Recipe),
    ("Which planet has the most moons?", Planet),
    ("Order three pizzas.", Order),
    ("Give a grade to a student named Ann.", Grade),
    ("List some prime numbers.", Numbers),
    ("I love this movie! What is the sentiment?", Sentiment),
    ("Name a film and its director.", Movie),
    ("Describe a shape.", Shape),
    ("Describe a small shop and two of its orders.", Inventory),
    ("Where is the Eiffel Tower?", City),
]


@pytest.fixture(scope="module")
def smol(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpEngine]:
    tmp = tmp_path_factory.mktemp("structured")
    with http_engine(None, tmp, "--served-model-name", MODEL, "--chunked-prefill-size", "256") as e:
        yield e


@pytest.fixture
def oai(smol: HttpEngine) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=smol.v1, api_key="-", max_retries=0, timeout=120.0) as client:
        yield client


@pytest.mark.timeout(600)
def test_parse_returns_an_object_for_every_schema(oai: openai.OpenAI) -> None:
    def parse(case: tuple[str, type[BaseModel]]) -> Any:
        prompt, model = case
        messages: Any = [{"role": "user", "content": prompt}]
        out = oai.chat.completions.parse(
            model=MODEL, messages=messages, response_format=model, max_tokens=128, temperature=0
        )
        return out.choices[0]

    with ThreadPoolExecutor(8) as pool:  # served as one batch, as many clients would be
        choices = list(pool.map(parse, CASES))
    for (prompt, model), choice in zip(CASES, choices, strict=True):
        assert choice.finish_reason == "stop", (prompt, choice.message.content)
        assert isinstance(choice.message.parsed, model), (prompt, choice.message.content)
        assert ": " in choice.message.content and "  " not in choice.message.content, "compact JSON"


@pytest.mark.timeout(300)
def test_regex_completions_match_every_time(oai: openai.OpenAI) -> None:
    pattern = r"\(\d{3}\) \d{3}-\d{4}"

    def complete(seed: int) -> Any:
        return oai.completions.create(
            model=MODEL, prompt="Call me at", max_tokens=24, temperature=1.0, seed=seed,
            extra_body={"regex": pattern},
        ).choices[0]  # fmt: skip

    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(complete, range(10)))
    assert all(re.fullmatch(pattern, c.text) and c.finish_reason == "stop" for c in choices), choices
    assert len({c.text for c in choices}) > 1, "sampled rows draw different numbers within the mask"


@pytest.mark.timeout(300)
def test_streamed_json_reassembles_to_the_whole_reply(oai: openai.OpenAI) -> None:
    schema = {"name": "pet", "schema": Pet.model_json_schema(), "strict": True}
    body: Any = dict(
        model=MODEL, messages=[{"role": "user", "content": "Describe a dog."}], max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": schema},
    )  # fmt: skip
    whole = oai.chat.completions.create(**body)
    chunks = oai.chat.completions.create(stream=True, **body)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert Pet.model_validate(json.loads(text))
    loose = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object."}], max_tokens=48,
        temperature=0, response_format={"type": "json_object"},
    )  # fmt: skip
    content = loose.choices[0].message.content or ""
    assert content.startswith("{") and (loose.choices[0].finish_reason == "length" or json.loads(content))


BAD_SCHEMA = {"type": "strin"}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
         "response_format"),
        ({"regex": "a(b"}, "regex"),
        ({"ebnf": "root ::= missing"}, "ebnf"),
        ({"regex": "a", "response_format": {"type": "json_object"}}, "regex"),
        ({"regex": "a", "ignore_eos": True}, "regex"),
    ],
)  # fmt: skip
def test_a_bad_constraint_is_a_400_naming_it(oai: openai.OpenAI, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_body=extra
        )
    assert isinstance(info.value.body, dict) and info.value.body["param"] == param
    ok = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_body={"regex": "ok"}
    )
    assert ok.choices[0].message.content == "ok", "the engine serves on"


def test_zmq_client_takes_a_grammar(smol: HttpEngine) -> None:
    with Client(smol.engine.endpoint, timeout_s=120) as c:
        out = c.generate("Is water wet? Answer:", max_new_tokens=8, temperature=0,
                         grammar=Grammar(kind="ebnf", spec='root ::= " yes" | " no"'))  # fmt: skip
        assert out.text in (" yes", " no") and out.token_ids[-1] == 2
        with pytest.raises(EngineError, match=r"sampling\.grammar cannot be compiled"):
            c.generate("x", grammar=Grammar(kind="json_schema", spec="{"))


@pytest.mark.timeout(300)
def test_free_rows_are_token_exact_beside_grammar_rows(smol: HttpEngine) -> None:
    """Served for real: the free requests' greedy tokens alone, then with grammar requests sent at
    the same moment (they share the batches)."""
    free = ["Tell me about rivers.", "What is a cat?", "Write a poem about snow.", "Explain gravity."]
    constrained = [
        "Describe a person as JSON.",
        "Give a city as JSON.",
        "A JSON list of fruits.",
        "JSON about dogs.",
    ]

    def run(prompt: str, grammar: Grammar | None = None) -> GenerateOutput:
        with Client(smol.engine.endpoint, timeout_s=120) as c:
            messages = [{"role": "user", "content": prompt}]
            options: Any = {"grammar": grammar} if grammar is not None else {}
            return c.generate(messages=messages, max_new_tokens=48, temperature=0, **options)

    with ThreadPoolExecutor(8) as pool:
        alone = [out.token_ids for out in pool.map(run, free)]
        beside = [pool.submit(run, p) for p in free]
        grammar_rows = [pool.submit(run, p, Grammar(kind="json_object")) for p in constrained]
        assert [f.result().token_ids for f in beside] == alone
        assert all(f.result().text.startswith("{") for f in grammar_rows)


def test_logprobs_are_those_of_the_masked_distribution(oai: openai.OpenAI) -> None:
    """After "ok" the grammar allows only EOS: its logprob is 0 and no masked token is offered."""
    out = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, logprobs=True,
        top_logprobs=3,
        extra_body={"regex": "ok"},
    )  # fmt: skip
    content = out.choices[0].logprobs.content if out.choices[0].logprobs else None
    assert content and "".join(t.token for t in content[:-1]) == "ok"
    assert content[-1].logprob == 0.0 and len(content[-1].top_logprobs) == 1
    assert all(alt.logprob is not None and alt.logprob <= 0 for t in content for alt in t.top_logprobs)
