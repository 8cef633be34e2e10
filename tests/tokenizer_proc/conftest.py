"""Fixtures shared by the tokenizer_proc tests: the embedded model's real tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from gpu_worker.weights.model_files import resolve_model
from tokenizer_proc.model_info import ModelInfo, load_tokenizer, read_model_info

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return resolve_model(None)


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return load_tokenizer(str(model_dir))


@pytest.fixture(scope="session")
def model_info(model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> ModelInfo:
    return read_model_info(str(model_dir), tokenizer)
