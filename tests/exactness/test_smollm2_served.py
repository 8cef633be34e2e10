"""The embedded SmolLM2-135M-Instruct served end to end, as a user would start it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import Client
from protocol import FinishReason
from tests.integration.engine import REPO, RunningEngine, running_engine

FRANCE = "What is the capital of France?"


@pytest.fixture(scope="module")
def smol_engine(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEngine]:
    # smollm2_dir converts the GGUF first if this machine never did; the launcher then finds the cache.
    with running_engine(None, tmp_path_factory.mktemp("smol"), "--chunked-prefill-size", "256") as e:
        yield e


@pytest.mark.timeout(300)
def test_cli_client_answers_the_france_question(smol_engine: RunningEngine) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "client", FRANCE, "--endpoint", smol_engine.endpoint],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "The capital of France is Paris."


@pytest.mark.timeout(300)
def test_generation_stops_at_im_end(smol_engine: RunningEngine) -> None:
    with Client(smol_engine.endpoint, timeout_s=120) as client:
        out = client.generate(
            messages=[{"role": "user", "content": FRANCE}], max_new_tokens=64, temperature=0
        )
    assert out.finish_reason == FinishReason.STOP
    assert out.token_ids[-1] == 2, "<|im_end|> (id 2) ends SmolLM2's turn"
    assert out.text == "The capital of France is Paris."
    assert out.usage is not None and out.usage.completion_tokens == len(out.token_ids)
