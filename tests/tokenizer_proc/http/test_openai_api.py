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
    assert lp.top_logprobs is None, "logprobs=0: the chosen token only"
    chat = oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, logprobs=True)
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    assert all(c.top_logprobs == [] for c in content)


def test_completion_top_logprobs_streamed_and_whole(oai: openai.OpenAI) -> None:
    kwargs = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 5,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    whole = oai.completions.create(**kwargs).choices[0]  # type: ignore[call-overload]
    lp = whole.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    assert len(lp.top_logprobs) == len(lp.tokens) == 6
    if not any(t.startswith("bytes:") for t in lp.tokens):  # no token that is part of a character
        assert "".join(lp.tokens) == whole.text
    for chosen, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 5 <= len(top) <= 6, "the 5 likeliest, plus the chosen token were it not among them"
        assert top[chosen] == logprob == max(top.values()), "greedy: the chosen token is the likeliest"
        assert list(top.values()) == sorted(top.values(), reverse=True)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    chunks = [c.choices[0] for c in oai.completions.create(stream=True, **kwargs) if c.choices]  # type: ignore[call-overload]
    streamed = [t for c in chunks if c.logprobs for t in (c.logprobs.top_logprobs or [])]
    assert streamed == lp.top_logprobs
    assert [o for c in chunks if c.logprobs for o in (c.logprobs.text_offset or [])] == lp.text_offset


def test_chat_top_logprobs_streamed_and_whole(oai: openai.OpenAI) -> None:
    kwargs = {"model": "tiny", "messages": CHAT, "max_tokens": 5, "temperature": 0, "logprobs": True,
              "top_logprobs": 3}  # fmt: skip
    # Floats compared exactly: both requests must compute the same rows. A first request for this
    # prompt computes it whole, a later one only what follows its cached pages, on other kernels
    # (other bits): one request beforehand gives both the same cached prefix.
    oai.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    whole = oai.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    content = whole.choices[0].logprobs.content
    assert content and len(content) == whole.usage.completion_tokens
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        # Greedy: the chosen token is the likeliest (bf16 logits may tie, so by logprob, not by token).
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == entry.logprob
        assert entry.token.startswith("bytes:") or entry.bytes == list(entry.token.encode())
    text = bytes(b for entry in content for b in entry.bytes or [])
    assert text.decode(errors="replace") == whole.choices[0].message.content, "bytes join up to the text"
    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))  # type: ignore[call-overload]
    cached = [u.prompt_tokens_details.cached_tokens for u in (whole.usage, chunks[-1].usage)]
    assert cached[0] == cached[1] > 0, cached
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []
    ]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]


def test_batched_prompts_are_choices_in_order(oai: openai.OpenAI) -> None:
    prompts = [PROMPT, "Once upon a time", "1, 2, 3,"]
    base = {"model": "tiny", "max_tokens": 5, "temperature": 0, "extra_body": {"ignore_eos": True}}
    singles = [oai.completions.create(prompt=p, **base) for p in prompts]  # type: ignore[call-overload]
    batch = oai.completions.create(prompt=prompts, **base)  # type: ignore[call-overload]
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.usage is not None and batch.usage.prompt_tokens == sum(
        s.usage.prompt_tokens for s in singles
    )
    assert batch.usage.completion_tokens == 15
    stream = oai.completions.create(
        prompt=prompts, stream=True, stream_options={"include_usage": True}, **base
    )  # type: ignore[call-overload]
    texts = ["", "", ""]
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in batch.choices]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 15
    ids = [oai.completions.create(prompt=[[504, 2337, 314], [504]], **base)]  # type: ignore[call-overload]
    assert len(ids[0].choices) == 2


def test_echo_returns_the_prompt_and_its_logprobs(oai: openai.OpenAI) -> None:
    base = {
        "model": "tiny",
        "prompt": PROMPT,
        "echo": True,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    out = oai.completions.create(max_tokens=3, logprobs=1, **base)  # type: ignore[call-overload]
    choice, usage = out.choices[0], out.usage
    assert choice.text.startswith(PROMPT) and usage is not None
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert len(lp.tokens) == usage.prompt_tokens + 3 == len(lp.token_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v < 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens[: usage.prompt_tokens]) == PROMPT
    zero = oai.completions.create(max_tokens=0, logprobs=1, **base).choices[0]  # type: ignore[call-overload]
    assert (zero.text, zero.finish_reason) == (PROMPT, "length")
    assert (
        zero.logprobs is not None and zero.logprobs.token_logprobs == lp.token_logprobs[: usage.prompt_tokens]
    )
    text_only = oai.completions.create(max_tokens=0, **base).choices[0]  # type: ignore[call-overload]
    assert (text_only.text, text_only.logprobs) == (PROMPT, None)
    chunks = list(oai.completions.create(max_tokens=3, logprobs=1, stream=True, **base))  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [("completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
     ("completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
     ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
     ("chat", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
     ("chat", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
     ("chat", {"messages": CHAT, "echo": True}, "echo")],
)  # fmt: skip
def test_bad_logprob_options_are_400s_and_the_engine_goes_on(
    api: HttpEngine, oai: openai.OpenAI, route: str, body: dict[str, object], param: str
) -> None:
    path = "/completions" if route == "completions" else "/chat/completions"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    resp = httpx.post(api.v1 + path, json={"model": "tiny", **body}, headers=headers, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param
    assert oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).choices[0].finish_reason


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
