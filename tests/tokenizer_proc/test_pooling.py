"""Embeddings in the tokenizer process: the pooling a model's files ask for, the sizes a vector
may be cut to, normalization, and the validation of embed requests."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from protocol.embedding import Pooling
from protocol.messages import ChatMessage, GenerateRequest, SamplingParams
from tokenizer_proc.model_info import ModelInfo
from tokenizer_proc.pooling import EmbeddingSpec, normalized, read_embedding_spec
from tokenizer_proc.validation import RequestRejected, validate_generate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _st_model(tmp_path: Path, **modes: bool) -> Path:
    tmp_path.mkdir()
    modules = [{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(modes))
    return tmp_path


def test_pooling_from_the_model_files(tmp_path: Path) -> None:
    plain = read_embedding_spec(tmp_path, {"hidden_size": 64})
    assert (plain.pooling, plain.hidden_size) == (Pooling.LAST, 64)
    mean = _st_model(tmp_path / "m", pooling_mode_mean_tokens=True, pooling_mode_cls_token=False)
    assert read_embedding_spec(mean, {}).pooling is Pooling.MEAN
    last = _st_model(tmp_path / "l", pooling_mode_lasttoken=True)
    assert read_embedding_spec(last, {}).pooling is Pooling.LAST
    cls = read_embedding_spec(_st_model(tmp_path / "c", pooling_mode_cls_token=True), {})
    assert cls.pooling is None and "pooling_mode_cls_token" in cls.unsupported


def test_the_pooling_flag_overrides_the_model_files(tmp_path: Path) -> None:
    assert read_embedding_spec(tmp_path, {}, "mean").pooling is Pooling.MEAN  # no ST config: LAST
    assert read_embedding_spec(tmp_path, {}, "auto").pooling is Pooling.LAST
    mean = _st_model(tmp_path / "m", pooling_mode_mean_tokens=True)
    assert read_embedding_spec(mean, {}, "last").pooling is Pooling.LAST
    cls = read_embedding_spec(_st_model(tmp_path / "c", pooling_mode_cls_token=True), {}, "mean")
    assert (cls.pooling, cls.unsupported) == (Pooling.MEAN, "")


def test_dimensions_only_where_the_model_has_them() -> None:
    plain = EmbeddingSpec(hidden_size=64)
    assert plain.dimensions_error(64) is None and "cannot be shortened" in (plain.dimensions_error(32) or "")
    sizes = EmbeddingSpec(hidden_size=64, matryoshka=(16, 32))
    assert sizes.dimensions_error(16) is None and "[16, 32]" in (sizes.dimensions_error(20) or "")
    anything = EmbeddingSpec(hidden_size=64, any_size=True)
    assert anything.dimensions_error(20) is None and anything.dimensions_error(65) is not None
    assert normalized([3.0, 4.0]) == [0.6, 0.8] and normalized([0.0, 0.0]) == [0.0, 0.0]


def _embed(tokenizer: PreTrainedTokenizerBase, info: ModelInfo, **fields: Any) -> Any:
    sampling = SamplingParams(max_new_tokens=fields.pop("max_new_tokens", 0))
    fields.setdefault("prompt", "Hello there")
    req = GenerateRequest(rid="e", embed=True, sampling=sampling, **fields)
    return validate_generate(req, tokenizer, info, random.Random(0))


def test_embed_requests_are_prompt_only(tokenizer: PreTrainedTokenizerBase, model_info: ModelInfo) -> None:
    valid = _embed(tokenizer, model_info)
    assert (valid.pooling, valid.max_new_tokens) == (Pooling.LAST, 0)
    assert _embed(tokenizer, model_info, prompt=None, input_ids=[5, 6]).input_ids == [5, 6]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_new_tokens": 4}, "sampling.max_new_tokens"),
        ({"prompt": None, "messages": [ChatMessage(role="user", content="hi")]}, "messages"),
        ({"echo": True}, "echo"),
        ({"logprobs": True}, "logprobs"),
        ({"n": 2}, "n"),
    ],
)
def test_embed_refusals(
    tokenizer: PreTrainedTokenizerBase, model_info: ModelInfo, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(RequestRejected) as err:
        _embed(tokenizer, model_info, **fields)
    assert err.value.param == param


def test_a_model_whose_pooling_is_not_done_refuses(tokenizer: PreTrainedTokenizerBase) -> None:
    spec = EmbeddingSpec(pooling=None, unsupported="the model's pooling ['x'] is not supported")
    info = ModelInfo(context_len=64, vocab_size=49152, eos_token_ids=(2,), embedding=spec)
    with pytest.raises(RequestRejected) as err:
        _embed(tokenizer, info)
    assert err.value.param == "embed" and "['x']" in str(err.value)
