"""The one-call decode of every decoder layer (csrc/decode_layers.c, backends/cpu/decode_layers.py):
bit for bit the modules' hidden states, on decode steps only, for the models it fits."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from bench.lib import gguf_models
from gpu_worker.backends.cpu.attention import KERNEL_MAX_EXTEND
from gpu_worker.backends.cpu.backend import CpuBackend
from gpu_worker.backends.cpu.decode_layers import FusedDecode
from gpu_worker.backends.cpu.experts import QuantRouter
from gpu_worker.backends.cpu.layouts import X8_LAYOUT
from gpu_worker.backends.cpu.quant import QuantLinear
from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.models.moe import SparseMoeBlock
from gpu_worker.weights.model_files import resolve_model
from tests.gpu_worker.helpers import GREEDY, MiniScheduler, count_calls
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


# q, k and v of three types (as a Q4_K_M file's q/k in Q4_K and v in Q6_K), gate and up of two.
MIXED = ONE_TYPE | {"attn_q": Q.Q8_0, "attn_k": Q.Q4_1, "attn_v": Q.Q4_0, "ffn_up": Q.Q4_1}


# A 4-layer Llama in llama.cpp's Q4_K_M mix (bench/lib/gguf_models.py: v and down in Q6_K in layers 2
# and 3, Q4_K elsewhere, the tied embedding Q6_K), with SmolLM2's vocabulary.
SMALL_Q4_K_M = gguf_models.Shape("small", hidden=256, layers=4, heads=4, kv_heads=2, ffn=512)


def make_q4_k_m_llama(out: Path) -> tuple[Path, Path]:
    """(HF dir, GGUF) of a random Q4_K_M Llama: the bench's maker writes the file, the real
    conversion (transformers, as the launcher's) the HF dir."""
    path = gguf_models.write_model(out / "q4_k_m.gguf", SMALL_Q4_K_M, "q4_k_m")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RIVULET_CACHE_DIR", str(out / "cache"))
        return resolve_model(str(path)), path


@pytest.fixture(scope="module", params=["one_type", "mixed", "q4_k_m"])
def quant_llama(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """A random Llama whose every Linear is one type, or whose merged Linears mix types."""
    out = tmp_path_factory.mktemp(f"{request.param}-llama")
    if request.param == "q4_k_m":
        return make_q4_k_m_llama(out)
    return make_random_llama(out, ONE_TYPE if request.param == "one_type" else MIXED)


def cpu_backend(runner: ModelRunner) -> CpuBackend:
    assert isinstance(runner.backend, CpuBackend), "GGUF blocks run on the CPU backend"
    return runner.backend


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
    quant_llama: tuple[Path, Path], dtype: str, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts of different lengths (pages crossed at different steps), then decode steps: each
    step's logits by the one call and by the modules (the same batch run again) are equal. 9 rows
    take the dense path of every Linear (set from 8 rows here; the committed table keeps some
    interleaved types on the integer path at any row count), 1 and 3 the integer one on x86. The
    one call runs on the decode steps and on no prefill (of rows longer than the kernel takes)."""
    assert_one_call_equals_the_modules(runner_of(quant_llama, dtype), rows, monkeypatch)


def assert_one_call_equals_the_modules(
    runner: ModelRunner, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill ``rows`` prompts, then 20 decode steps each run by the one call and by the modules."""
    fused = cpu_backend(runner).fused_decode
    assert isinstance(fused, FusedDecode)
    if rows == 9:
        for module in runner.model.modules():  # type: ignore[attr-defined]
            impl = getattr(module, "impl", None)
            if isinstance(impl, QuantLinear):
                impl.dense_min_rows = [8] * len(impl.dense_min_rows)
    calls = count_calls(fused.kernels, "decode_layers", monkeypatch)
    sched = MiniScheduler(runner.num_pages, runner.config.page_size)
    lens = [KERNEL_MAX_EXTEND + 5 + 7 * i for i in range(rows)]  # a shorter row decodes through the kernel
    prefill = sched.batch([(idx, 0, list(range(3, 3 + n)), True, GREEDY) for idx, n in enumerate(lens)])
    tokens = runner.execute(prefill).token_ids
    assert not calls, "a prefill step ran the one call"
    for step in range(20):
        batch = sched.batch([(idx, lens[idx] + step, [tokens[idx]], True, None) for idx in range(rows)])
        one_call = runner.compute_logits(batch)
        cpu_backend(runner).fused_decode = None
        modules = runner.compute_logits(batch)  # the same K/V rewritten with the same values
        cpu_backend(runner).fused_decode = fused
        assert torch.equal(one_call, modules), (step, float((one_call - modules).abs().max()))
        tokens = one_call.float().argmax(dim=-1).tolist()
    assert len(calls) == 20


# Qwen3 (Q/K norms per head), Qwen3-MoE and Mixtral (8 experts, 2 a token, every layer sparse) in
# the Q4_K_M mix, small, written by the bench's maker and read by the real loader.
SMALL_QWEN3 = gguf_models.Shape(
    "small-qwen3", hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, arch="qwen3", rope_theta=1e6, eps=1e-6
)
SMALL_QWEN3_MOE = dataclasses.replace(
    SMALL_QWEN3, name="small-qwen3moe", arch="qwen3moe", tied=False, experts=8, experts_used=2, expert_ffn=256
)
SMALL_MIXTRAL = dataclasses.replace(
    SMALL_QWEN3_MOE, name="small-mixtral", arch="llama", ffn=256
)  # no Q/K norms


@pytest.fixture(
    scope="module", params=[SMALL_QWEN3, SMALL_QWEN3_MOE, SMALL_MIXTRAL], ids=lambda shape: shape.name
)
def qwen3_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp(request.param.name)
    path = gguf_models.write_model(out / "model.gguf", request.param, "q4_k_m")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RIVULET_CACHE_DIR", str(out / "cache"))
        return resolve_model(str(path)), path


@pytest.mark.parametrize("rows", [1, 3, 9], ids=["1row", "3rows", "9rows_dense"])
def test_qwen3_norms_and_experts_run_in_the_one_call(
    qwen3_model: tuple[Path, Path], rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Q/K norms per head, and a router with experts in place of the MLP, in the one call: the
    modules' logits bit for bit (float32; in bf16 the modules norm q and k with torch and the one
    call declines for models with those norms, as a bf16 runner shows)."""
    runner = runner_of(qwen3_model, "float32")
    sparse = [m for m in runner.model.modules() if isinstance(m, SparseMoeBlock)]  # type: ignore[attr-defined]
    assert all(isinstance(m.router, QuantRouter) for m in sparse)
    assert_one_call_equals_the_modules(runner, rows, monkeypatch)
    if rows == 1:  # bf16: the one call where no Q/K norms are (Mixtral), the modules where they are
        norms = any(getattr(m, "qk_norm", False) for m in runner.model.modules())  # type: ignore[attr-defined]
        bf16 = runner_of(qwen3_model, "bfloat16")
        assert (cpu_backend(bf16).fused_decode is None) == norms
        if not norms:
            assert_one_call_equals_the_modules(bf16, 3, monkeypatch)


def test_merged_parts_of_types_run_in_the_one_call(tmp_path: Path) -> None:
    """q, k and v of three types are three parts of one Linear, and the layer stays in the one call."""
    fused = cpu_backend(runner_of(make_random_llama(tmp_path, MIXED), "float32")).fused_decode
    assert fused is not None
    layer = fused.model.model.layers[0]
    assert [p.type for p in layer.self_attn.qkv_proj.impl.weight.parts] == [Q.Q8_0, Q.Q4_1, Q.Q4_0]
    assert [p.type for p in layer.mlp.gate_up_proj.impl.weight.parts] == [Q.Q4_0, Q.Q4_1]


def test_q4_k_m_file_runs_in_the_one_call_interleaved(tmp_path: Path) -> None:
    """Through the real loader: every layer in the one call, q/k in Q4_K beside v in Q6_K where the
    mix has it, each part in the K-quants' interleaved layout."""
    fused = cpu_backend(runner_of(make_q4_k_m_llama(tmp_path), "float32")).fused_decode
    assert fused is not None
    types = [
        [p.type for p in layer.self_attn.qkv_proj.impl.weight.parts] for layer in fused.model.model.layers
    ]
    assert types == [[Q.Q4_K]] * 2 + [[Q.Q4_K, Q.Q4_K, Q.Q6_K]] * 2
    for layer in fused.model.model.layers:
        for impl in (layer.self_attn.qkv_proj.impl, layer.mlp.down_proj.impl):
            assert all(p.layout == X8_LAYOUT for p in impl.weight.parts)


def test_models_it_does_not_fit_run_their_modules(tmp_path: Path) -> None:
    """A projection the file holds in float (v here) makes its merged Linear dense: the modules run."""
    types = {name: t for name, t in ONE_TYPE.items() if name != "attn_v"}
    runner = runner_of(make_random_llama(tmp_path, types), "float32")
    assert cpu_backend(runner).fused_decode is None
