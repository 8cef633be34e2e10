"""The one-call decode of every decoder layer (csrc/decode_layers.c, backends/cpu/decode_layers.py):
bit for bit the modules' hidden states, on decode steps only, for the models it fits."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.backends.cpu.backend import CpuBackend
from gpu_worker.backends.cpu.quant import QuantLinear
from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from tests.gpu_worker.helpers import GREEDY, MiniScheduler
from tests.gpu_worker.test_gguf_weights import Q, make_random_llama

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

# Every Linear one type (q, k and v alike, so the merged qkv is one), the types differing between them.
ONE_TYPE = {
    "attn_q": Q.Q4_1,
    "attn_k": Q.Q4_1,
    "attn_v": Q.Q4_1,
    "attn_output": Q.Q8_0,
    "ffn_gate": Q.Q4_0,
    "ffn_up": Q.Q4_0,
    "ffn_down": Q.Q4_1,
    "token_embd": Q.Q8_0,
}



def cpu_backend(runner: ModelRunner) -> CpuBackend:
    assert isinstance(runner.backend, CpuBackend), "GGUF blocks run on the CPU backend"
    return runner.backend

@pytest.fixture(scope="module")
def one_type_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_random_llama(tmp_path_factory.mktemp("one-type-llama"), ONE_TYPE)


def runner_of(paths: tuple[Path, Path], dtype: str) -> ModelRunner:
    hf_dir, gguf_path = paths
    config = WorkerConfig(
        model_path=str(hf_dir), gguf_path=str(gguf_path), weight_dtype="gguf", dtype=dtype,
        kv_cache_tokens=2048,
    )  # fmt: skip
    return ModelRunner(config)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 3, 9], ids=["1row", "3rows", "9rows_dense"])
def test_one_call_equals_the_modules_bit_for_bit(
    one_type_llama: tuple[Path, Path], dtype: str, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts of different lengths (pages crossed at different steps), then decode steps: each
    step's logits by the one call and by the modules (the same batch run again) are equal. 9 rows
    take the dense path of every Linear (set from 8 rows here; the committed table keeps some
    interleaved types on the integer path at any row count), 1 and 3 the integer one on x86. The
    one call runs on the decode steps and on no prefill."""
    runner = runner_of(one_type_llama, dtype)
    fused = cpu_backend(runner).fused_decode
    assert fused is not None
    if rows == 9:
        for module in runner.model.modules():  # type: ignore[attr-defined]
            impl = getattr(module, "impl", None)
            if isinstance(impl, QuantLinear):
                impl.dense_min_rows = [8] * len(impl.dense_min_rows)
    calls: list[int] = []
    original = fused.kernels.decode_layers

    def counted(*args: Any) -> None:
        calls.append(1)
        original(*args)

    monkeypatch.setattr(fused.kernels, "decode_layers", counted)
    sched = MiniScheduler(runner.num_pages, runner.config.page_size)
    lens = [5 + 7 * i for i in range(rows)]
    prefill = sched.batch([(slot, 0, list(range(3, 3 + n)), True, GREEDY) for slot, n in enumerate(lens)])
    tokens = runner.execute(prefill).token_ids
    assert not calls, "a prefill step ran the one call"
    for step in range(20):
        batch = sched.batch([(slot, lens[slot] + step, [tokens[slot]], True, None) for slot in range(rows)])
        one_call = runner.compute_logits(batch)
        cpu_backend(runner).fused_decode = None
        modules = runner.compute_logits(batch)  # the same K/V rewritten with the same values
        cpu_backend(runner).fused_decode = fused
        assert torch.equal(one_call, modules), (step, float((one_call - modules).abs().max()))
        tokens = one_call.float().argmax(dim=-1).tolist()
    assert len(calls) == 20


def test_models_it_does_not_fit_run_their_modules(tmp_path: Path) -> None:
    """A merged qkv of three types (as a Q4_K_M file's can be) keeps the modules."""
    runner = runner_of(make_random_llama(tmp_path), "float32")
    assert cpu_backend(runner).fused_decode is None
