"""One engine (tiny model, HTTP and ZMQ) shared by the bad-input and load tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tokenizer_proc.http.server import HttpEngine, http_engine


@pytest.fixture(scope="package")
def engine(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpEngine]:
    tmp = tmp_path_factory.mktemp("reliability")
    with http_engine(tiny_llama_dir, tmp, "--served-model-name", "tiny") as e:
        yield e
