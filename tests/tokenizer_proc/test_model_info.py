"""Reading context length, vocab and EOS ids from differently shaped model configs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tokenizer_proc.model_info import read_model_info

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def test_gpt2_style_config_and_eos_lists(tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"n_positions": 1024, "vocab_size": 50257, "eos_token_id": 7})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    info = read_model_info(str(tmp_path), tokenizer)
    assert info.context_len == 1024
    assert info.vocab_size == 50257
    assert info.eos_token_ids == (5, 7, tokenizer.eos_token_id)  # union, in order, no duplicates


def test_missing_context_length_is_an_error(tmp_path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10}))
    with pytest.raises(ValueError, match="context length"):
        read_model_info(str(tmp_path), tokenizer)
