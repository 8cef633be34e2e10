"""Reasoning content end to end: a random Qwen3 model through the real loader, with a Qwen3-style
chat template written into its model directory, served over HTTP to the ``openai`` package.

A random model writes noise, so what it proves is the plumbing, exactly: the template's
``enable_thinking`` (through ``chat_template_kwargs``) decides whether the prompt opens a think
block, and the reply is then reasoning (``reasoning_content``) or content, equal token for token to
the completion of the same prompt ids, streamed and not. The split at ``</think>`` itself is pinned
by crafted token streams (tests/tokenizer_proc/chat/test_replies.py).

Token for token needs both runs to compute the same bits: the engine has no prefix cache. With it,
the second of two requests for one prompt reuses its first 16 tokens and computes the other 3 on
other kernels (attention in the C kernel over the paged KV, not torch's SDPA over fresh K/V): valid,
other bits. And in bfloat16 this random model's greedy choice meets exact ties (acting as AVX2, the
thinking reply's 6th token: "ph" and "MY" both at logprob -4.058), so those bits decide the reply.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import save_with_smollm2_tokenizer, tiny_config
from tests.tokenizer_proc.chat.qwen3_style import QWEN3_STYLE_TEMPLATE
from tests.tokenizer_proc.http.server import http_engine
from tokenizer_proc.model_info import load_tokenizer

ASK: list[Any] = [{"role": "user", "content": "Why is the sky blue?"}]
TOKENS = 8


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A random 2-layer Qwen3 with SmolLM2's tokenizer and a Qwen3-style chat template."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("tiny-qwen3")
    # initializer_range 0.3: at 0.02 a random model writes one token over and over
    config = tiny_config(Qwen3Config, head_dim=16, initializer_range=0.3)
    save_with_smollm2_tokenizer(Qwen3ForCausalLM, config, out, smollm2_dir)
    (out / "chat_template.jinja").write_text(QWEN3_STYLE_TEMPLATE)
    return out


@pytest.fixture(scope="module")
def qwen3(qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    args = ("--served-model-name", "q", "--disable-radix-cache")  # the module's docstring says why
    with http_engine(qwen3_dir, tmp_path_factory.mktemp("qwen3-http"), *args) as engine:
        with openai.OpenAI(base_url=engine.v1, api_key="none", max_retries=0, timeout=60.0) as client:
            yield client


def _completion_of_prompt(client: openai.OpenAI, qwen3_dir: Path, **template_kwargs: Any) -> Any:
    """What the model writes after the chat prompt, asked through the completions endpoint."""
    tokenizer = load_tokenizer(str(qwen3_dir))
    text = tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False, **template_kwargs)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return client.completions.create(
        model="q", prompt=ids, max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )


def _chat(client: openai.OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(
        model="q", messages=ASK, max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True, **kw}
    )


def test_thinking_reply_is_reasoning_content(qwen3: openai.OpenAI, qwen3_dir: Path) -> None:
    completion = _completion_of_prompt(qwen3, qwen3_dir)
    expected = completion.choices[0].text
    assert "</think>" not in expected and expected.strip()  # the model never closes the block it is in
    chat = _chat(qwen3)
    # the same prompt ids, each computed whole, so the same bits (the module's docstring says why)
    usages = [
        (u.prompt_tokens, u.prompt_tokens_details.cached_tokens) for u in (completion.usage, chat.usage)
    ]
    assert usages[0] == usages[1] and usages[0][1] == 0
    message = chat.choices[0].message
    assert message.model_extra["reasoning_content"] == expected.lstrip()
    assert message.content == ""


def test_enable_thinking_false_gives_content(qwen3: openai.OpenAI, qwen3_dir: Path) -> None:
    expected = _completion_of_prompt(qwen3, qwen3_dir, enable_thinking=False).choices[0].text
    message = _chat(qwen3, chat_template_kwargs={"enable_thinking": False}).choices[0].message
    assert message.content == expected and "reasoning_content" not in (message.model_extra or {})


def test_streamed_reasoning_adds_up_to_the_whole(qwen3: openai.OpenAI) -> None:
    whole = _chat(qwen3).choices[0].message.model_extra["reasoning_content"]
    stream = qwen3.chat.completions.create(
        model="q",
        messages=ASK,
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    pieces = [(c.choices[0].delta.model_extra or {}).get("reasoning_content") for c in stream if c.choices]
    assert "".join(p for p in pieces if p) == whole and sum(1 for p in pieces if p) > 1


def test_responses_reasoning_item(qwen3: openai.OpenAI) -> None:
    """The Responses API gives the reasoning as a ``reasoning`` item (whole and streamed), and effort
    "none" switches the template's thinking off."""
    chat = qwen3.chat.completions.create(model="q", messages=ASK, max_tokens=TOKENS, temperature=0)
    kw: Any = {"model": "q", "input": ASK, "max_output_tokens": TOKENS, "temperature": 0}
    r = qwen3.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning"]
    assert r.output[0].content[0].text == chat.choices[0].message.model_extra["reasoning_content"]  # type: ignore[union-attr, index]
    assert r.usage is not None and 0 < r.usage.output_tokens_details.reasoning_tokens <= TOKENS
    events = list(qwen3.responses.create(stream=True, **kw))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == r.output[0].content[0].text and len(deltas) > 1  # type: ignore[union-attr, index]
    off = qwen3.responses.create(reasoning={"effort": "none"}, **kw)
    plain = qwen3.chat.completions.create(
        model="q", messages=ASK, max_tokens=TOKENS, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    ).choices[0].message.content  # fmt: skip
    assert [o.type for o in off.output] == ["message"] and off.output_text == plain
