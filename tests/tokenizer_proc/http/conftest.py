"""One engine with the HTTP API (tiny model, API key set) shared by the tests of this package."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.tokenizer_proc.http.server import API_KEY, HttpEngine, http_engine


@pytest.fixture(scope="package")
def api(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpEngine]:
    tmp = tmp_path_factory.mktemp("http")
    with http_engine(tiny_llama_dir, tmp, "--api-key", API_KEY, "--served-model-name", "tiny") as e:
        yield e


@pytest.fixture
def oai(api: HttpEngine) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=api.v1, api_key=API_KEY, max_retries=0, timeout=60.0) as client:
        yield client
