"""--tp-size 2 on the tiny Gemma 4 (tests/gemma4_models.py, its global layers given 2 KV heads so that
every layer's heads split): each rank its heads of every layer (pool layers of its own shapes, the
KV-shared layers reading their sources' pages), its range of the MoE block's experts; greedy tokens
equal HF float64's through chunked prefill and a prefix-cache hit."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from client import Client
from tests.conftest import TOKENIZER_FILES
from tests.exactness.test_moe import hf_greedy
from tests.gemma4_models import save_gemma4
from tests.integration.engine import running_engine
from tests.models import VOCAB

FLAGS = ("--dtype", "float64", "--chunked-prefill-size", "8", "--page-size", "4", "--tp-size", "2")


@pytest.mark.timeout(600)
def test_two_ranks_equal_hf(tmp_path: Path, smollm2_dir: Path) -> None:
    hf = save_gemma4(tmp_path / "model", seed=3, num_global_key_value_heads=2)
    for name in TOKENIZER_FILES:  # ids below VOCAB decode as SmolLM2's tokens: text is not compared
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, tmp_path / "model" / name)
    rng = random.Random(5)
    shared = [rng.randrange(3, VOCAB - 8) for _ in range(20)]
    prompts = [shared + [rng.randrange(3, VOCAB - 8) for _ in range(n)] for n in (3, 9)]
    expected = hf_greedy(hf, prompts, 8)
    (tmp_path / "engine").mkdir()
    with running_engine(tmp_path / "model", tmp_path / "engine", *FLAGS) as engine:
        with Client(engine.endpoint, timeout_s=240) as c:
            got = [c.generate(input_ids=p, max_new_tokens=8, temperature=0, ignore_eos=True) for p in prompts]
    assert "tensor-parallel all-reduce: shared memory" in (tmp_path / "engine" / "launcher.log").read_text()
    assert [out.token_ids for out in got] == expected
    assert got[1].usage is not None and got[1].usage.cached_tokens >= 16, "the shared prefix is cached"
