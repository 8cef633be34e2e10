"""--tp-size 2 on a latent-attention model through real engine processes: the tiny DeepSeek-V3's
heads split over two worker ranks (each its own latent pool, whole), its routed experts too; greedy
tokens equal HF's float64 through chunked prefill and a prefix-cache hit."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from client import Client
from tests.conftest import TOKENIZER_FILES
from tests.integration.engine import running_engine
from tests.mla_models import VOCAB, hf_greedy, make_prompts, save_mla_model

FLAGS = ("--dtype", "float64", "--chunked-prefill-size", "8", "--page-size", "4", "--tp-size", "2")


@pytest.mark.timeout(300)
def test_two_ranks_match_hf(tmp_path: Path, smollm2_dir: Path) -> None:
    model = tmp_path / "model"
    hf = save_mla_model("v3", model, seed=5)
    for name in TOKENIZER_FILES:  # ids below VOCAB decode as SmolLM2's tokens: text is not compared
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, model / name)
    rng = random.Random(6)
    first = make_prompts(6, (21,))[0]
    prompts = [first, first[:16] + [rng.randrange(3, VOCAB) for _ in range(4)]]  # the second hits the cache
    expected = hf_greedy(hf, prompts, 6)
    (tmp_path / "engine").mkdir()
    with (
        running_engine(model, tmp_path / "engine", *FLAGS) as engine,
        Client(engine.endpoint, timeout_s=120) as c,
    ):
        got = [c.generate(input_ids=p, max_new_tokens=6, temperature=0, ignore_eos=True) for p in prompts]
        assert "tensor-parallel all-reduce" in engine.log()
    assert [out.token_ids for out in got] == expected
    assert got[1].usage is not None and got[1].usage.cached_tokens >= 12
