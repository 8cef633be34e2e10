"""The official ``openai`` package against a real engine: both endpoints, streaming and not."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from client import Client
from tests.tokenizer_proc.http.server import API_KEY, HttpEngine, metrics, wait_idle_and_free

PROMPT = "The capital of France is"
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name three rivers."}]


def test_models_lists_the_served_name(oai: openai.OpenAI) -> None:
    models = oai.models.list().data
    assert [m.id for m in models] == ["tiny"]


def test_completion_matches_the_zmq_client(oai: openai.OpenAI, api: HttpEngine) -> None:
    out = oai.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    with Client(api.engine.endpoint, timeout_s=60) as c:
        ref = c.generate(PROMPT, max_new_tokens=12, temperature=0, ignore_eos=True)
    choice = out.choices[0]
    assert (choice.text, choice.finish_reason) == (ref.text, "length")
    assert out.usage is not None and (out.usage.prompt_tokens, out.usage.completion_tokens) == (
        ref.usage.prompt_tokens if ref.usage else -1,
        12,
    )
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == "tiny"


def test_streamed_completion_adds_up_to_the_whole(oai: openai.OpenAI) -> None:
    kwargs = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 10,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = oai.completions.create(**kwargs)  # type: ignore[call-overload]
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))  # type: ignore[call-overload]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert (
        not chunks[-1].choices and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    )


def test_chat_streaming_and_not_agree(oai: openai.OpenAI) -> None:
    whole = oai.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=8, temperature=0)
    stream = oai.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=8, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert whole.usage is not None and whole.usage.completion_tokens <= 8
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_chosen_token_logprobs(oai: openai.OpenAI) -> None:
    out = oai.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, logprobs=0, extra_body={"ignore_eos": True}
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and len(lp.token_logprobs) == 5
    # < 0, not <= 0: the worker computes logprobs only for requests that ask, and a missed ask reads 0.0
    assert all(v < 0 for v in lp.token_logprobs) and "".join(lp.tokens or []) == out.choices[0].text
    chat = oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, logprobs=True)
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, logprobs=True, top_logprobs=2)
    assert err.value.body["param"] == "top_logprobs"  # type: ignore[index]


def test_stop_string_and_seed(oai: openai.OpenAI) -> None:
    base = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
    greedy = oai.completions.create(temperature=0, **base).choices[0].text  # type: ignore[call-overload]
    stop = greedy[len(greedy) // 2 :][:3]
    stopped = oai.completions.create(temperature=0, stop=[stop], **base).choices[0]  # type: ignore[call-overload]
    assert (stopped.text, stopped.finish_reason) == (greedy[: greedy.index(stop)], "stop")
    a, b, c = (oai.completions.create(temperature=1.0, seed=s, **base).choices[0].text for s in (7, 7, 8))  # type: ignore[call-overload]
    assert a == b and a != c


def test_errors_are_openai_shaped(oai: openai.OpenAI, api: HttpEngine) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        oai.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert not_found.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as too_long:
        oai.completions.create(model="tiny", prompt="word " * 2000, max_tokens=1)
    assert too_long.value.body["code"] == "context_length_exceeded"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        oai.completions.create(model="tiny", prompt="x", max_tokens=1, temperature=-1)
    assert bad.value.body["param"] == "temperature"  # type: ignore[index]
    with openai.OpenAI(base_url=api.v1, api_key="wrong", max_retries=0) as intruder:
        with pytest.raises(openai.AuthenticationError):
            intruder.models.list()
    assert httpx.post(api.v1 + "/completions", json={"prompt": "x"}).status_code == 401
    assert httpx.get(api.base_url + "/health").json() == {"status": "ok"}  # no key needed


def test_http_disconnect_mid_stream_aborts_and_frees_kv(api: HttpEngine) -> None:
    before = metrics(api.base_url)
    body = {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", api.v1 + "/completions", json=body, headers=headers, timeout=30) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # tokens are flowing
    m = wait_idle_and_free(api.base_url, 10.0)
    aborted = 'rivulet_requests_finished_total{finish_reason="abort"}'
    assert m[aborted] == before[aborted] + 1
    assert m["rivulet_generation_tokens_total"] - before["rivulet_generation_tokens_total"] < 900


def test_http_disconnect_while_waiting_for_a_whole_response(api: HttpEngine) -> None:
    body = {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(api.v1 + "/completions", json=body, headers=headers, timeout=1.0)
    wait_idle_and_free(api.base_url, 10.0)


def test_metrics_count_what_was_served(oai: openai.OpenAI, api: HttpEngine) -> None:
    before = metrics(api.base_url)
    oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, extra_body={"ignore_eos": True})
    m = wait_idle_and_free(api.base_url)
    assert m["rivulet_generation_tokens_total"] - before["rivulet_generation_tokens_total"] == 4
    ttft, itl = "rivulet_time_to_first_token_seconds_count", "rivulet_inter_token_latency_seconds_count"
    assert (m[ttft] - before[ttft], m[itl] - before[itl]) == (1, 3)
    assert m['rivulet_time_to_first_token_seconds_bucket{le="+Inf"}'] == m[ttft]
    assert 0 <= m["rivulet_prefix_cache_hit_rate"] <= 1 and m["rivulet_kv_usage_ratio"] == 0
