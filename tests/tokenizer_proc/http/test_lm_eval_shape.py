"""lm-evaluation-harness's ``local-completions`` loglikelihood requests and ``local-chat-completions``
generation requests, replayed on a running engine.

Its exact request shape: several token-id prompts in one request, ``echo=true, logprobs=1,
max_tokens=1, temperature=0`` (and max_tokens 0, which other harnesses send); it reads
``token_logprobs[ctxlen:-1]`` and checks greediness with ``logprob == max(top_logprobs)``. The
engine serves the tiny Llama in float64 with 8-token prefill chunks, and every prompt position's
logprob must equal HF's float64 ``log_softmax`` within TOLERANCE (JSON carries float64 exactly).
The ZMQ client's ``generate`` takes the same options.

``local-chat-completions`` (``LocalChatCompletion._create_payload``) posts one conversation per
request: ``messages``, ``max_tokens`` (its ``max_gen_toks``, 256 by default), ``temperature: 0``,
``stop`` (the task's ``until`` plus the EOS string, cut to 4) and ``seed: 1234``, and reads
``choices[i].message.content`` by ``index``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from client import Client
from tests.tokenizer_proc.http.server import HttpEngine, http_engine

TOLERANCE = 1e-8


@pytest.fixture(scope="module")
def engine64(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpEngine]:
    tmp = tmp_path_factory.mktemp("lm-eval")
    args = ("--dtype", "float64", "--chunked-prefill-size", "8", "--served-model-name", "tiny")
    with http_engine(tiny_llama_dir, tmp, *args) as e:
        yield e


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float64).eval()


def _hf_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().log_softmax(-1)


def _prompts() -> list[list[int]]:
    """Contexts with continuations, as lm-eval tokenizes them: two share their context."""
    rng = random.Random(5)
    context = [rng.randrange(100, 40000) for _ in range(13)]
    return [
        context + [rng.randrange(100, 40000) for _ in range(3)],
        context + [rng.randrange(100, 40000) for _ in range(2)],
        [rng.randrange(100, 40000) for _ in range(21)],
        [rng.randrange(100, 40000)],
    ]


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_loglikelihood_request(engine64: HttpEngine, hf_model: Any, max_tokens: int) -> None:
    prompts = _prompts()
    body = {"model": "tiny", "prompt": prompts, "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
            "seed": 1234, "echo": True}  # fmt: skip
    resp = httpx.post(engine64.v1 + "/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    assert out["usage"]["completion_tokens"] == max_tokens * len(prompts)
    for prompt, choice in zip(prompts, choices, strict=True):
        lp = choice["logprobs"]
        token_logprobs, top_logprobs = lp["token_logprobs"], lp["top_logprobs"]
        assert len(token_logprobs) == len(top_logprobs) == len(prompt) + max_tokens
        assert token_logprobs[0] is None and top_logprobs[0] is None, "nothing predicts the first token"
        reference = _hf_logprobs(hf_model, prompt)
        expected = reference[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
        got = torch.tensor(token_logprobs[1 : len(prompt)], dtype=torch.float64)
        assert torch.allclose(got, expected, atol=TOLERANCE, rtol=0), (got - expected).abs().max()
        # lm-eval's greediness test over the prompt positions, against HF's argmax.
        for position in range(1, len(prompt)):
            is_greedy = token_logprobs[position] == max(top_logprobs[position].values())
            assert is_greedy == (reference[position - 1].argmax().item() == prompt[position])
            assert len(top_logprobs[position]) in (1, 2), "the likeliest token, and the chosen one"
        if max_tokens:
            generated = _hf_logprobs(hf_model, prompt)[-1]
            assert abs(token_logprobs[-1] - generated.max().item()) < TOLERANCE, "greedy: the likeliest"
        assert choice["finish_reason"] == "length"


def test_zmq_client_echo_with_top_logprobs(engine64: HttpEngine, hf_model: Any) -> None:
    prompt = _prompts()[2]
    with Client(engine64.engine.endpoint, timeout_s=120) as c:
        out = c.generate(input_ids=prompt, max_new_tokens=2, temperature=0, logprobs=True, top_logprobs=4,
                         echo=True)  # fmt: skip
    assert out.prompt_token_ids == prompt and out.prompt_logprobs is not None and out.prompt_top_logprobs
    reference = _hf_logprobs(hf_model, prompt + out.token_ids)
    assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
    for position in range(1, len(prompt)):
        expected = reference[position - 1]
        assert abs((out.prompt_logprobs[position] or 0.0) - expected[prompt[position]].item()) < TOLERANCE
        top = out.prompt_top_logprobs[position]
        assert top is not None and top.token_ids == expected.topk(4).indices.tolist()
    assert out.top_logprobs is not None and len(out.top_logprobs) == 2
    for step, top in enumerate(out.top_logprobs):
        expected = reference[len(prompt) - 1 + step]
        assert top.token_ids == expected.topk(4).indices.tolist() and top.token_ids[0] == out.token_ids[step]
        assert (
            max(abs(a - b) for a, b in zip(top.logprobs, expected.topk(4).values.tolist(), strict=True))
            < TOLERANCE
        )


def _lm_eval_chat(
    engine: HttpEngine, messages: list[dict[str, str]], max_tokens: int, stop: list[str]
) -> Any:
    body = {"messages": messages, "model": "tiny", "max_tokens": max_tokens, "temperature": 0,
            "stop": stop[:4], "seed": 1234}  # fmt: skip
    resp = httpx.post(engine.v1 + "/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_lm_eval_chat_completions_request(engine64: HttpEngine) -> None:
    """A few-shot conversation (lm-eval's ``--apply_chat_template --fewshot_as_multiturn``) in its
    request shape: the reply is the greedy text cut before the first stop string, every time."""
    messages = [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "Question: 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Question: 3 + 5?"},
    ]
    free = _lm_eval_chat(engine64, messages, 24, ["Question:", "</s>"])  # text of the random model
    text = free["choices"][0]["message"]["content"]
    assert free["choices"][0]["finish_reason"] == "length" and len(text) > 12, text
    cut = text[8:11]  # a stop string the greedy reply is sure to write
    out = _lm_eval_chat(engine64, messages, 24, ["Question:", cut, "</s>", "<|im_end|>", "\n\n"])
    [choice] = out["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == text[: text.index(cut)], (text, cut)
    assert out["usage"]["prompt_tokens"] == free["usage"]["prompt_tokens"]
    again = _lm_eval_chat(engine64, messages, 24, ["Question:", cut, "</s>", "<|im_end|>"])
    assert again["choices"][0]["message"]["content"] == choice["message"]["content"]
    default = _lm_eval_chat(engine64, messages[-1:], 256, ["Question:"])  # lm-eval's max_gen_toks
    assert default["choices"][0]["finish_reason"] in ("stop", "length")
    assert default["usage"]["completion_tokens"] <= 256
