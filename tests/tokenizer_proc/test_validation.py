"""Request validation: every rejection names its field; valid requests become scheduler input."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import msgspec
import pytest

from protocol.messages import ChatMessage, GenerateRequest, SamplingParams
from tokenizer_proc.model_info import ModelInfo
from tokenizer_proc.validation import RequestRejected, validate_generate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _validate(tokenizer: PreTrainedTokenizerBase, info: ModelInfo, **fields: Any) -> Any:
    sampling = fields.pop("sampling", {})
    fields.setdefault("rid", "r1")
    if not {"prompt", "messages", "input_ids"} & fields.keys():
        fields["prompt"] = "Hello there"
    req = GenerateRequest(sampling=SamplingParams(**sampling), **fields)
    return validate_generate(req, tokenizer, info, random.Random(0))


REJECTIONS = [
    ({"prompt": "hi", "input_ids": [1, 2]}, "exactly one of prompt, messages, input_ids"),
    ({"prompt": None, "messages": None, "input_ids": None, "rid": "x"}, "exactly one"),
    ({"prompt": ""}, "prompt must not be empty"),
    ({"input_ids": []}, "input_ids must not be empty"),
    ({"input_ids": [5, 10**9]}, "input_ids"),
    ({"input_ids": [-1]}, "input_ids"),
    ({"messages": []}, "messages must not be empty"),
    ({"rid": ""}, "rid"),
    ({"sampling": {"max_new_tokens": 0}}, "sampling.max_new_tokens"),
    ({"sampling": {"temperature": -0.5}}, "sampling.temperature"),
    ({"sampling": {"temperature": float("nan")}}, "sampling.temperature"),
    ({"sampling": {"temperature": float("inf")}}, "sampling.temperature"),
    ({"sampling": {"top_p": 0.0}}, "sampling.top_p"),
    ({"sampling": {"top_p": 1.5}}, "sampling.top_p"),
    ({"sampling": {"min_p": -0.1}}, "sampling.min_p"),
    ({"sampling": {"min_p": 1.1}}, "sampling.min_p"),
    ({"sampling": {"top_k": -2}}, "sampling.top_k"),
    ({"sampling": {"seed": -1}}, "sampling.seed"),
    ({"sampling": {"seed": 2**63}}, "sampling.seed"),
    ({"sampling": {"stop": ["ok", ""]}}, "sampling.stop"),
    ({"sampling": {"stop_token_ids": [49152]}}, "sampling.stop_token_ids"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs needs logprobs"),
    ({"prompt": None, "messages": [ChatMessage(role="user", content="hi")], "echo": True}, "echo"),
    ({"sampling": {"presence_penalty": 2.01}}, "sampling.presence_penalty"),
    ({"sampling": {"frequency_penalty": -2.5}}, "sampling.frequency_penalty"),
    ({"sampling": {"frequency_penalty": float("nan")}}, "sampling.frequency_penalty"),
    ({"sampling": {"repetition_penalty": 0.0}}, "sampling.repetition_penalty"),
    ({"sampling": {"repetition_penalty": float("inf")}}, "sampling.repetition_penalty"),
    ({"sampling": {"logit_bias": {49152: 1.0}}}, "sampling.logit_bias"),
    ({"sampling": {"logit_bias": {-1: 1.0}}}, "sampling.logit_bias"),
    ({"sampling": {"logit_bias": {5: -100.5}}}, "sampling.logit_bias"),
    ({"sampling": {"logit_bias": {i: 1.0 for i in range(301)}}}, "sampling.logit_bias"),
    ({"sampling": {"min_tokens": 9, "max_new_tokens": 8}}, "sampling.min_tokens"),
    ({"sampling": {"min_tokens": -1}}, "sampling.min_tokens"),
]


@pytest.mark.parametrize(("fields", "message"), REJECTIONS)
def test_rejections_name_the_field(
    tokenizer: PreTrainedTokenizerBase, model_info: ModelInfo, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(RequestRejected, match=message.replace(".", r"\.")):
        _validate(tokenizer, model_info, **fields)


def test_prompt_filling_the_context_is_rejected(tokenizer: PreTrainedTokenizerBase) -> None:
    info = ModelInfo(context_len=8, vocab_size=len(tokenizer), eos_token_ids=(2,))
    with pytest.raises(RequestRejected, match="context length is 8"):
        _validate(tokenizer, info, input_ids=list(range(10, 18)))
    ok = _validate(tokenizer, info, input_ids=list(range(10, 17)), sampling={"max_new_tokens": 100})
    assert ok.max_new_tokens == 1  # clamped to context_len - prompt_len


def test_max_new_tokens_is_clamped_to_the_context_or_refused(tokenizer: PreTrainedTokenizerBase) -> None:
    """Clamped for a ZMQ client (and an HTTP request that set no limit); refused when the HTTP
    client set it (clamp_to_context=False), as OpenAI and vLLM refuse it."""
    info = ModelInfo(context_len=50, vocab_size=len(tokenizer), eos_token_ids=(2,))
    ok = _validate(tokenizer, info, input_ids=[5] * 20, sampling={"max_new_tokens": 1000})
    assert ok.max_new_tokens == 30
    ok = _validate(tokenizer, info, input_ids=[5] * 20, sampling={"max_new_tokens": 7})
    assert ok.max_new_tokens == 7
    req = GenerateRequest(rid="r1", input_ids=[5] * 20, sampling=SamplingParams(max_new_tokens=31))
    with pytest.raises(
        RequestRejected, match="is 31: 20 prompt tokens [+] 31 = 51, over the context length 50"
    ) as caught:
        validate_generate(req, tokenizer, info, random.Random(0), clamp_to_context=False)
    assert (caught.value.param, caught.value.code) == ("sampling.max_new_tokens", "context_length_exceeded")
    fits = msgspec.structs.replace(req, sampling=SamplingParams(max_new_tokens=30))
    assert (
        validate_generate(fits, tokenizer, info, random.Random(0), clamp_to_context=False).max_new_tokens
        == 30
    )


def test_valid_prompt_request(tokenizer: PreTrainedTokenizerBase, model_info: ModelInfo) -> None:
    ok = _validate(
        tokenizer,
        model_info,
        prompt="The capital of France is",
        stream=True,
        sampling={"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 2**63 - 1, "stop_token_ids": [13, 2]},
    )
    assert ok.input_ids == tokenizer.encode("The capital of France is")
    assert ok.stop_token_ids == [2, 13]  # EOS first, duplicates dropped
    assert (ok.sampler.seed, ok.sampler.top_k, ok.stream) == (2**63 - 1, 0, True)


def test_ignore_eos_drops_eos_from_stop_ids(
    tokenizer: PreTrainedTokenizerBase, model_info: ModelInfo
) -> None:
    ok = _validate(tokenizer, model_info, sampling={"ignore_eos": True, "stop_token_ids": [13]})
    assert ok.stop_token_ids == [13]
    assert model_info.eos_token_ids == (2,)  # SmolLM2's <|im_end|>


def test_chat_messages_use_the_template(tokenizer: PreTrainedTokenizerBase, model_info: ModelInfo) -> None:
    ok = _validate(tokenizer, model_info, messages=[ChatMessage(role="user", content="hi")])
    text = str(tokenizer.decode(ok.input_ids))
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_seeds_are_drawn_from_the_config_seed(
    tokenizer: PreTrainedTokenizerBase, model_info: ModelInfo
) -> None:
    def seeds(config_seed: int) -> list[int]:
        rng = random.Random(config_seed)
        req = GenerateRequest(rid="r", prompt="x")
        return [validate_generate(req, tokenizer, model_info, rng).sampler.seed for _ in range(3)]

    assert seeds(1) == seeds(1)
    assert seeds(1) != seeds(2)
    assert len(set(seeds(1))) == 3


def test_model_info_reads_the_embedded_model(model_info: ModelInfo) -> None:
    assert (model_info.context_len, model_info.vocab_size, model_info.eos_token_ids) == (8192, 49152, (2,))


def test_echo_allows_max_new_tokens_zero(tokenizer: PreTrainedTokenizerBase, model_info: ModelInfo) -> None:
    ok = _validate(tokenizer, model_info, prompt="Hi there", echo=True, logprobs=True, top_logprobs=20,
                   sampling={"max_new_tokens": 0})  # fmt: skip
    assert (ok.max_new_tokens, ok.echo_text, ok.prompt_logprobs) == (0, "Hi there", True)
    assert (ok.sampler.logprobs, ok.sampler.top_logprobs) == (True, 20)
    ids = _validate(tokenizer, model_info, input_ids=[504, 2337], echo=True, sampling={"max_new_tokens": 0})
    assert ids.echo_text == tokenizer.decode([504, 2337]) and not ids.prompt_logprobs


def test_penalties_become_worker_penalties_only_when_they_change_a_logit(
    tokenizer: PreTrainedTokenizerBase, model_info: ModelInfo
) -> None:
    neutral = {"presence_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": {5: 0.0}, "min_tokens": 0}
    assert _validate(tokenizer, model_info, sampling=neutral).sampler.penalties is None
    fields = {"presence_penalty": 0.5, "logit_bias": {i: 1.0 for i in range(300)}, "min_tokens": 3}
    valid = _validate(tokenizer, model_info, input_ids=[4, 5, 6], sampling={**fields, "stop_token_ids": [9]})
    p = valid.sampler.penalties
    assert p is not None and (p.prompt_len, p.presence, p.min_tokens) == (3, 0.5, 3)
    assert p.bias_ids == list(range(300)) and p.min_tokens_ids == valid.stop_token_ids == [
        *model_info.eos_token_ids,
        9,
    ]
    no_stop = {"min_tokens": 3, "ignore_eos": True}
    assert _validate(tokenizer, model_info, sampling=no_stop).sampler.penalties is None, "nothing to mask"
