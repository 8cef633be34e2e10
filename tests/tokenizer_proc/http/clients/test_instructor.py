"""instructor in its TOOLS, JSON_SCHEMA and RESPONSES_TOOLS modes against the tiny engine: the reply
parses into the response model on the first try (``max_retries=0``, so a refusal or an unparsable
reply fails the test instead of being retried).

instructor is not in the ``test`` extra (pyproject.toml says why): these tests run where it was
installed by hand (``pip install --no-deps instructor docstring-parser``) and skip elsewhere."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.tokenizer_proc.http.clients.common import API_KEY, MODEL, Sent, Verdict

instructor = pytest.importorskip("instructor")

QUESTION = "Is it sunny in Paris?"


def _patched(sent: Sent, mode: Any) -> Any:
    client = openai.OpenAI(base_url=sent.v1, api_key=API_KEY, max_retries=0, http_client=sent.http_client())
    return instructor.from_openai(client, mode=mode)


@pytest.mark.parametrize("mode_name", ["TOOLS", "JSON_SCHEMA"])
def test_chat_modes_parse(sent: Sent, mode_name: str) -> None:
    client = _patched(sent, instructor.Mode[mode_name])
    messages = [{"role": "user", "content": QUESTION}]
    verdict = client.chat.completions.create(
        model=MODEL, messages=messages, response_model=Verdict, max_retries=0, temperature=0, max_tokens=40
    )
    assert isinstance(verdict, Verdict)
    body = sent.to("chat/completions")[0]
    assert ("tool_choice" in body) == (mode_name == "TOOLS") and ("response_format" in body) != (
        mode_name == "TOOLS"
    )


def test_responses_tools_mode_parses(sent: Sent) -> None:
    """instructor forces its tool and sends the format too (item 1 of issue 51)."""
    client = _patched(sent, instructor.Mode.RESPONSES_TOOLS)
    kw = {"temperature": 0, "max_output_tokens": 40, "max_retries": 0}
    verdict = client.responses.create(model=MODEL, input=QUESTION, response_model=Verdict, **kw)
    assert isinstance(verdict, Verdict)
    body = sent.to("responses")[0]
    assert body["tool_choice"] == {"type": "function", "name": "Verdict"} and "format" in body["text"]
