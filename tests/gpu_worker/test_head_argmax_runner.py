"""The greedy draw in the head, served (model_runner.py's ``head_argmax``, sampling/head_argmax.py):
a batch whose draw is the argmax alone takes it from the head's kernel, without the logits, and
draws the tokens the logits route draws, step by step; a batch with a sampled row keeps the logits.
A random Llama whose tied Q8_0 head is kept in blocks, a tiny Gemma 4 whose Q8_0 head's logits are
soft-capped (its one-call decode too), and a tiny gpt-oss whose untied head is BF16 (the bench file's;
a Llama subclass, so Llama's ``compute_argmax``), float32 activations."""

from __future__ import annotations

import shutil
from typing import Any

import gguf
import pytest

from gpu_worker.backends.cpu.quant import QuantLinear
from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.models.gpt_oss import GptOssForCausalLM
from protocol.sampling import WorkerSampling
from tests.exactness.test_gemma4_gguf import gguf_runner
from tests.exactness.test_gpt_oss import hf_gpt_oss, tiny_gpt_oss_config
from tests.exactness.test_moe import runner_for
from tests.gemma4_gguf import write_gemma4_gguf
from tests.gemma4_models import save_gemma4
from tests.gpt_oss_gguf import write_gpt_oss_gguf
from tests.gpu_worker.helpers import GREEDY, MiniScheduler, count_calls
from tests.gpu_worker.test_gguf_weights import make_random_llama

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

Q8 = gguf.GGMLQuantizationType.Q8_0
BF16 = gguf.GGMLQuantizationType.BF16
GEMMA4_KINDS = (
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "inp_gate",
    "proj",
)
GEMMA4_BLOCKS = dict.fromkeys((*GEMMA4_KINDS, "token_embd"), Q8)  # the tied head in Q8_0 blocks too
SAMPLED = WorkerSampling(temperature=0.8, top_k=-1, top_p=1.0, min_p=0.0, seed=3)


@pytest.fixture(scope="module", params=["llama", "gemma4", "gpt_oss"])
def runner(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    path = tmp_path_factory.mktemp(f"head_argmax_{request.param}")
    if request.param == "llama":
        hf_dir, gguf_file = make_random_llama(path)
        config = WorkerConfig(model_path=str(hf_dir), gguf_path=str(gguf_file), weight_dtype="gguf",
                              dtype="float32", kv_cache_tokens=1024, num_threads=1)  # fmt: skip
        return ModelRunner(config)
    if request.param == "gpt_oss":
        model = hf_gpt_oss(tiny_gpt_oss_config(layers=2, swiglu_limit=7.0), seed=4)
        write_gpt_oss_gguf(path / "model.gguf", model, gguf.GGMLQuantizationType.MXFP4, head=BF16)
        return runner_for(path, "gguf", dtype="float32", weight_dtype="gguf")
    hf = save_gemma4(path / "hf", enable_moe_block=False, hidden_size_per_layer_input=32)
    write_gemma4_gguf(path / "model.gguf", hf, GEMMA4_BLOCKS)
    return gguf_runner(path, path / "model.gguf", dtype="float32", kv_cache_tokens=1024, weight_dtype="gguf")


def test_greedy_rows_draw_the_logits_tokens(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    model: Any = runner.model
    impl = model.lm_head.impl
    assert isinstance(impl, QuantLinear) and runner.head_argmax, "the head is a kernel's, in blocks"
    if isinstance(model, GptOssForCausalLM):
        assert impl.weight.parts[0].type == BF16, "gpt-oss's head in BF16 blocks, as the bench file's"
    if hasattr(model, "final_softcap") and model.final_softcap is not None:
        assert model.final_softcap.fused is not None, "Gemma 4's soft-cap: the kernels' operations"
    calls = count_calls(impl, "argmax", monkeypatch)
    rows = 5
    sched = MiniScheduler(runner.num_pages, runner.config.page_size)
    lens = [9 + 4 * i for i in range(rows)]
    prefill = sched.batch([(i, 0, list(range(3 + i, 3 + i + n)), True, GREEDY) for i, n in enumerate(lens)])
    tokens = runner.execute(prefill).token_ids
    assert len(calls) == 1, "the prefill's greedy draw in the head"
    for step in range(8):
        batch = sched.batch([(i, lens[i] + step, [tokens[i]], True, None) for i in range(rows)])
        runner.head_argmax = True
        in_head = runner.execute(batch).token_ids
        runner.head_argmax = False  # the same K/V rewritten with the same values
        from_logits = runner.execute(batch).token_ids
        assert in_head == from_logits, step
        assert in_head == runner.backend.greedy(runner.compute_logits(batch)).tolist()
        tokens = in_head
    runner.head_argmax = True
    assert len(calls) == 1 + 8


def test_a_sampled_row_keeps_the_logits(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    model: Any = runner.model
    calls = count_calls(model.lm_head.impl, "argmax", monkeypatch)
    sched = MiniScheduler(runner.num_pages, runner.config.page_size)
    batch = sched.batch([(10, 0, [5, 6, 7], True, GREEDY), (11, 0, [8, 9], True, SAMPLED)])
    assert len(runner.execute(batch).token_ids) == 2
    assert not calls
    greedy = sched.batch([(12, 0, [5, 6, 7, 8], True, GREEDY)])
    assert runner.execute(greedy).token_ids == runner.backend.greedy(runner.compute_logits(greedy)).tolist()
    assert len(calls) == 1
