"""The one-call decode of a latent-attention model (csrc/decode_mla.c, backends/cpu/decode_mla.py): bit
for bit the modules' hidden states, on decode steps only, for the DeepSeek-V2 layers it implements."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from bench.lib import gguf_mla_model
from gpu_worker.backends.cpu.backend import CpuBackend
from gpu_worker.backends.cpu.decode_mla import MlaDecode, why_not
from gpu_worker.backends.cpu.latent_heads import LatentHeads
from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.models.deepseek_moe import DeepseekMoe
from gpu_worker.weights.model_files import resolve_model
from tests.exactness import inprocess
from tests.exactness.test_mla_gguf import NEW_TOKENS, gguf_runner
from tests.gpu_worker.helpers import GREEDY, MiniScheduler, count_calls
from tests.mla_gguf import write_mla_gguf
from tests.mla_models import hf_greedy, hf_mla_model, make_prompts, tiny_mla_config

pytestmark = [
    pytest.mark.skipif(
        shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler for the kernels"
    ),
    pytest.mark.cpu_kinds,  # CI runs it again as an AVX2-only CPU
]

# DeepSeek-V2-Lite's layout, small: a dense first layer, then experts (8, 2 a token) beside 2 shared
# ones; kv_b split into attn_k_b / attn_v_b blocks; the Q4_K_M mix of the bench's file.
SMALL = dataclasses.replace(
    gguf_mla_model.V2_LITE, hidden=256, layers=3, heads=4, vocab=49152, context=512, rank=256, rope=32,
    nope=64, v=64, experts=8, used=2, expert_ffn=256, shared=2, dense_ffn=512,
)  # fmt: skip


@pytest.fixture(scope="module")
def mla_paths(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("mla")
    path = gguf_mla_model.write_model(out / "model.gguf", "q4_k_m", SMALL)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RIVULET_CACHE_DIR", str(out / "cache"))
        return resolve_model(str(path)), path


def runner_of(paths: tuple[Path, Path], dtype: str, kv_dtype: str = "auto") -> ModelRunner:
    hf_dir, gguf_path = paths
    config = WorkerConfig(
        model_path=str(hf_dir), gguf_path=str(gguf_path), weight_dtype="gguf", dtype=dtype,
        kv_cache_dtype=kv_dtype, page_size=16, kv_cache_tokens=4096, num_threads=1,
    )  # fmt: skip
    return ModelRunner(config)


def backend(runner: ModelRunner) -> CpuBackend:
    assert isinstance(runner.backend, CpuBackend)
    return runner.backend


def decode_steps(runner: ModelRunner, rows: int, monkeypatch: pytest.MonkeyPatch, steps: int = 12) -> int:
    """Prefill ``rows`` prompts (pages crossed at different steps), then decode steps, each run by the
    one call (where it takes the step) and by the modules: the logits equal. Returns the one call's
    count."""
    fused = backend(runner).fused_decode
    assert isinstance(fused, MlaDecode)
    calls = count_calls(fused, "call", monkeypatch)
    sched = MiniScheduler(runner.num_pages, runner.config.page_size)
    lens = [11 + 7 * i for i in range(rows)]
    prefill = sched.batch([(idx, 0, list(range(3, 3 + n)), True, GREEDY) for idx, n in enumerate(lens)])
    tokens = runner.execute(prefill).token_ids
    assert not calls, "a prefill step ran the one call"
    for step in range(steps):
        batch = sched.batch([(idx, lens[idx] + step, [tokens[idx]], True, None) for idx in range(rows)])
        one_call = runner.compute_logits(batch)
        backend(runner).fused_decode = None
        modules = runner.compute_logits(batch)  # the same pool rows rewritten with the same values
        backend(runner).fused_decode = fused
        assert torch.equal(one_call, modules), (step, float((one_call - modules).abs().max()))
        tokens = one_call.float().argmax(dim=-1).tolist()
    return len(calls)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 3])
def test_one_call_equals_the_modules_bit_for_bit(
    mla_paths: tuple[Path, Path], dtype: str, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert decode_steps(runner_of(mla_paths, dtype), rows, monkeypatch) == 12


@pytest.mark.parametrize("kv_dtype", ["float16", "fp8_e4m3"])
def test_routed_scaling_and_other_pools(
    mla_paths: tuple[Path, Path], kv_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A routed_scaling_factor (the weights scaled after the router, rounded as torch's mul) and a
    float16 or float8 pool (each row rounded as it is written, float8's clamped): the modules' bits."""
    runner = runner_of(mla_paths, "float32", kv_dtype)
    model: Any = runner.model
    fused = backend(runner).fused_decode
    assert isinstance(fused, MlaDecode)
    for module in model.modules():
        if isinstance(module, DeepseekMoe):
            object.__setattr__(module.gate, "args", dataclasses.replace(module.gate.args, scaling=2.5))
    fused._layers = None  # the structs again, with the scale
    assert decode_steps(runner, 2, monkeypatch, steps=6) == 6


# Every Linear, kv_b's halves and the experts in Q8_0 blocks (a tiny model's widths are whole blocks).
ALL_Q8 = {
    kind: gguf.GGMLQuantizationType.Q8_0
    for kind in ("attn_q_a", "attn_q_b", "attn_kv_a_mqa", "attn_k_b", "attn_v_b", "attn_output")
    + ("ffn_gate", "ffn_up", "ffn_down", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    + ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
}


def test_q_lora_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V2 with q_lora_rank (q_a, its norm, q_b) and a routed_scaling_factor of 1.5, without
    group-limited routing, from llama.cpp's form of the file."""
    import transformers

    cfg = tiny_mla_config(
        "v2_lite", qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, kv_lora_rank=64,
        intermediate_size=128, moe_intermediate_size=64,
    )  # fmt: skip
    cfg.q_lora_rank, cfg.routed_scaling_factor = 32, 1.5  # (v2_lite's config: None, 1.0)
    torch.manual_seed(5)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").eval()
    write_mla_gguf(tmp_path / "model.gguf", hf, True, ALL_Q8)
    runner = gguf_runner(tmp_path, dtype="float32", weight_dtype="gguf", page_size=16)
    assert runner.hf_config.q_lora_rank == 32
    assert decode_steps(runner, 2, monkeypatch, steps=6) == 6


def test_greedy_tokens_as_hf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Served in float32 through the one call (prompts chunked, mixed with decode rows), the tokens
    are HF's float64 greedy ones on the file's weights."""
    hf = hf_mla_model(
        "v2_lite", seed=4, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, kv_lora_rank=64
    )
    types = {**ALL_Q8, "attn_q": gguf.GGMLQuantizationType.Q8_0}
    hf.load_state_dict(write_mla_gguf(tmp_path / "model.gguf", hf, True, types), strict=False)
    runner = gguf_runner(tmp_path, dtype="float32", weight_dtype="gguf", page_size=16)
    fused = backend(runner).fused_decode
    assert isinstance(fused, MlaDecode)
    calls = count_calls(fused, "call", monkeypatch)
    prompts = make_prompts(7, (1, 3, 17, 40, 9))
    got, _ = inprocess.generate(runner, prompts, NEW_TOKENS, chunked_prefill_size=16, enable_mixed_chunk=True)
    assert calls and got == hf_greedy(hf, prompts, NEW_TOKENS)


def test_what_runs_the_modules(mla_paths: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """More rows than the products on blocks take (the modules' bmm) run the modules; so does a model
    whose router the C code does not implement, named at start."""
    runner = runner_of(mla_paths, "float32")
    rows = LatentHeads.max_rows + 1
    assert decode_steps(runner, rows, monkeypatch, steps=2) == 0
    model: Any = runner.model
    gate = model.model.layers[1].mlp.gate
    object.__setattr__(gate, "args", dataclasses.replace(gate.args, scoring="sigmoid"))
    assert why_not(model, torch.float32) == "mlp.gate: DeepseekRouter's scoring='sigmoid' has no C decode"
