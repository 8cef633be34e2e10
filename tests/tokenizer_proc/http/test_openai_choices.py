"""n > 1 and best_of through the official ``openai`` package and the ZMQ client, on a real engine:
choice i of an n-request is what a single request with seed + i gives, the prompt counts once in
usage, streams interleave the choices by index, and best_of keeps the best by logprob per token."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from client import Client
from protocol.messages import GenerateOutput
from tests.tokenizer_proc.http.server import API_KEY, HttpEngine

PROMPT = "The capital of France is"
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name three rivers."}]
SEED = 11
SAMPLED = dict(max_tokens=12, temperature=1.0, seed=SEED, extra_body={"ignore_eos": True})


def singles(api: HttpEngine, count: int, **options: object) -> list[GenerateOutput]:
    """What single requests with seeds SEED .. SEED + count - 1 give (ZMQ client)."""
    with Client(api.engine.endpoint, timeout_s=60) as c:
        return [
            c.generate(max_new_tokens=12, temperature=1.0, seed=SEED + i, ignore_eos=True, **options)  # type: ignore[call-overload]
            for i in range(count)
        ]


def test_completion_choices_equal_single_requests_with_seed_plus_i(
    oai: openai.OpenAI, api: HttpEngine
) -> None:
    out = oai.completions.create(model="tiny", prompt=PROMPT, n=3, **SAMPLED)  # type: ignore[call-overload]
    refs = singles(api, 3, prompt=PROMPT)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [r.text for r in refs]
    assert len({c.text for c in out.choices}) == 3, "sampled choices differ"
    assert out.usage is not None and refs[0].usage is not None
    assert out.usage.prompt_tokens == refs[0].usage.prompt_tokens, "the prompt counts once"
    assert out.usage.completion_tokens == 36


def test_chat_choices_and_a_batch_of_prompts(oai: openai.OpenAI, api: HttpEngine) -> None:
    chat = oai.chat.completions.create(model="tiny", messages=CHAT, n=2, **SAMPLED)  # type: ignore[call-overload]
    refs = singles(api, 2, messages=[{"role": "user", "content": "Name three rivers."}])
    assert [c.message.content for c in chat.choices] == [r.text for r in refs]
    prompts = [PROMPT, "Once upon a time"]
    batch = oai.completions.create(model="tiny", prompt=prompts, n=2, **SAMPLED)  # type: ignore[call-overload]
    expected = [r.text for p in prompts for r in singles(api, 2, prompt=p)]
    assert [c.index for c in batch.choices] == [0, 1, 2, 3], "prompt-major, as OpenAI numbers them"
    assert [c.text for c in batch.choices] == expected


def test_streamed_choices_interleave_and_reassemble(oai: openai.OpenAI) -> None:
    whole = oai.completions.create(model="tiny", prompt=PROMPT, n=2, **SAMPLED)  # type: ignore[call-overload]
    stream = oai.completions.create(
        model="tiny", prompt=PROMPT, n=2, stream=True, stream_options={"include_usage": True}, **SAMPLED
    )  # type: ignore[call-overload]
    texts, reasons, usage, order = ["", ""], [None, None], None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            order.append(choice.index)
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [c.text for c in whole.choices] and reasons == ["length", "length"]
    assert order.index(1) < len(order) - order[::-1].index(0) - 1, "the choices' chunks interleave"
    assert usage is not None and whole.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, 24)


def test_best_of_keeps_the_choices_with_the_best_logprob_per_token(
    oai: openai.OpenAI, api: HttpEngine
) -> None:
    out = oai.completions.create(model="tiny", prompt=PROMPT, n=2, best_of=4, **SAMPLED)  # type: ignore[call-overload]
    refs = singles(api, 4, prompt=PROMPT, logprobs=True)
    ranked = sorted(refs, key=lambda r: -sum(r.logprobs or []) / len(r.logprobs or [1]))
    assert [c.text for c in out.choices] == [r.text for r in ranked[:2]]
    assert out.choices[0].logprobs is None, "logprobs were not asked for"
    assert out.usage is not None and out.usage.completion_tokens == 48, "every drawn choice counts"


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"n": 0}, "n"), ({"n": 129}, "n"), ({"n": 3, "best_of": 2}, "best_of"),
     ({"n": 2, "best_of": 3, "stream": True}, "best_of")],
)  # fmt: skip
def test_bad_choice_counts_name_the_parameter(api: HttpEngine, fields: dict[str, object], param: str) -> None:
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 2, **fields}).encode()
    req = urllib.request.Request(
        f"{api.v1}/completions",
        body,
        {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    assert err.value.code == 400
    assert json.loads(err.value.read())["error"]["param"] == param


def test_zmq_client_choices(api: HttpEngine) -> None:
    refs = singles(api, 3, prompt=PROMPT)
    with Client(api.engine.endpoint, timeout_s=60) as c:
        finals = c.generate_choices(
            PROMPT, n=3, max_new_tokens=12, temperature=1.0, seed=SEED, ignore_eos=True
        )
        texts = ["", "", ""]
        for reply in c.generate(PROMPT, stream=True, n=3, max_new_tokens=12, temperature=1.0, seed=SEED,
                                ignore_eos=True):  # fmt: skip
            texts[reply.index] += reply.text
        with pytest.raises(ValueError, match="generate_choices"):
            c.generate(PROMPT, n=2)
    assert [f.index for f in finals] == [0, 1, 2] and [f.text for f in finals] == [r.text for r in refs]
    assert texts == [r.text for r in refs]


def test_echo_with_prompt_logprobs_reaches_every_choice(oai: openai.OpenAI) -> None:
    out = oai.completions.create(
        model="tiny", prompt=PROMPT, n=2, echo=True, logprobs=1, max_tokens=3, temperature=1.0, seed=SEED
    )
    single = oai.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    prompt_part = single.choices[0].logprobs
    assert prompt_part is not None and prompt_part.token_logprobs is not None
    num_prompt = len(prompt_part.token_logprobs)
    for choice in out.choices:
        assert choice.text.startswith(PROMPT) and choice.logprobs is not None
        assert choice.logprobs.token_logprobs is not None
        assert choice.logprobs.token_logprobs[:num_prompt] == prompt_part.token_logprobs
        assert len(choice.logprobs.token_logprobs) == num_prompt + 3
