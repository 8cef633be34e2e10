"""Gemma 3 in the one-call decode (csrc/decode_layers.c, backends/cpu/decode_gemma.py): a tiny random
Gemma 3 in a GGUF whose q/k/gate/up are Q5_0 (the type llama.cpp's Q4_K_M mix gives Gemma 3 270M's
640-wide rows), v and o Q5_1, through the real loader. Its layers (norms by 1 + w, the norms after
attention and MLP, GELU-tanh, Q/K norms, local and global rope, a window on the local layers) run
their decode steps in the one call, equal to the modules' bit for bit, and its greedy tokens are HF
float64's on the file's own weights (or near-tied there, as the 8-bit activations allow)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.backends.cpu import kernels as cpu_kernels
from gpu_worker.backends.cpu.decode_layers import FusedDecode, not_in_c, why_not
from gpu_worker.backends.cpu.kind import requested_kind
from gpu_worker.config import WorkerConfig
from gpu_worker.forward_context import AttentionOptions
from gpu_worker.model_runner import ModelRunner
from gpu_worker.models.gemma import GemmaForCausalLM
from tests.block_quants import Q
from tests.exactness import inprocess
from tests.exactness.test_smollm2_bf16 import first_divergence_within_top2
from tests.gguf_writer import write_gguf
from tests.gpu_worker.helpers import count_calls
from tests.gpu_worker.test_decode_layers import assert_one_call_equals_the_modules, cpu_backend
from tests.models import WINDOW, tiny_config

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

TYPES = {
    "attn_q": Q.Q5_0,
    "attn_k": Q.Q5_0,
    "attn_v": Q.Q5_1,
    "attn_output": Q.Q5_1,
    "ffn_gate": Q.Q5_0,
    "ffn_up": Q.Q5_0,
    "ffn_down": Q.Q8_0,
    "token_embd": Q.Q8_0,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul_is_torchs_within_float_rounding(dtype: torch.dtype) -> None:
    """The kernel GemmaMLP and the one call gate with: torch's tanh GELU times up, within float32
    rounding (x / (1 + exp(-t)), not 0.5 x (1 + tanh(t / 2)), whose 1 + tanh cancels to ~|x| ulp(1)
    in the negative tail), over a partial last vector and gates far past both tails."""
    kernels = cpu_kernels.load(requested_kind())
    assert kernels is not None
    gate_up = (torch.randn(5, 2 * 601) * 4).to(dtype)  # 601: a partial last vector
    gate_up[0, :6] = torch.tensor([-80.0, 100.0, 0.0, -0.0, -1e4, 1e4])
    gate, up = gate_up.chunk(2, dim=-1)
    exact = F.gelu(gate.double(), approximate="tanh") * up.double()
    got = kernels.gelu_tanh_mul(gate_up)
    assert got.dtype == dtype and got.shape == (5, 601)
    ulp = 2.0**-23 if dtype == torch.float32 else 2.0**-7  # the product and the GELU's roundings
    bound = 4 * ulp * exact.abs() + 2 * 2.0**-24 * (gate.double() * up.double()).abs() + 1e-30
    assert bool(((got.double() - exact).abs() <= bound).all()), float((got.double() - exact).abs().max())


def test_softcap_is_torchs_within_float_rounding() -> None:
    """The kernel Gemma 4's soft-capped logits take in place: cap * tanh(x / cap) within a few
    float32 ulps of float64's, over a partial last vector, the small-|y| series and its edge, both
    saturated tails and signed zeros; a vocabulary-sized row goes to the threads."""
    kernels = cpu_kernels.load(requested_kind())
    assert kernels is not None
    cap = 30.0
    x = torch.randn(3, 1001) * 40  # 1001: a partial last vector
    x[0, :10] = torch.tensor([0.0, -0.0, 1e-30, -1e-3, 7.49, -7.51, 600.0, -600.0, 3e38, -3e38])
    wide = torch.randn(2, 70000) * 20
    for logits in (x, wide):
        exact = torch.tanh(logits.double() / cap) * cap
        got = logits.clone()
        kernels.softcap_(got, cap)
        bound = 4 * 2.0**-23 * exact.abs() + 1e-45
        assert bool(((got.double() - exact).abs() <= bound).all()), float((got.double() - exact).abs().max())
        if logits is x:
            assert got[0, :2].tolist() == [0.0, 0.0] and torch.signbit(got[0, :2]).tolist() == [False, True]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """(dir holding the HF checkpoint and its GGUF, HF float64 model of the file's weights)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("gemma3")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("gemma3_text", tie=True)).double().eval()
    model.generation_config.eos_token_id = None  # the runner stops at no token either
    with torch.no_grad():  # norms off 1 + 0, so the folded 1 + w is tested; a small embedding
        for name, param in model.named_parameters():  # (x sqrt(hidden) at the input)
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
        model.get_input_embeddings().weight.mul_(0.03)
    held = write_gguf(out / "model.gguf", model, types=TYPES)
    model.load_state_dict({k: v.double() for k, v in held.items()}, strict=False)
    model.save_pretrained(out, safe_serialization=True)
    return out, model


def runner_of(out: Path, dtype: str = "float32") -> ModelRunner:
    config = WorkerConfig(
        model_path=str(out), gguf_path=str(out / "model.gguf"), weight_dtype="gguf", dtype=dtype,
        kv_cache_tokens=2048, num_threads=1,
    )  # fmt: skip
    return ModelRunner(config)


@pytest.mark.parametrize("rows", [1, 3])
def test_gemma3_one_call_equals_the_modules(
    gemma3: tuple[Path, Any], rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts past the window, 20 decode steps each by the one call and by the modules: equal
    logits; each layer carries its window, its rope table and its four norms into the call."""
    out, _ = gemma3
    runner = runner_of(out)
    assert isinstance(runner.model, GemmaForCausalLM)
    assert_one_call_equals_the_modules(runner, rows, monkeypatch)
    fused = cpu_backend(runner).fused_decode
    assert isinstance(fused, FusedDecode) and fused._layers is not None
    assert [layer.window for layer in fused._layers] == [WINDOW, 0, WINDOW]
    assert [layer.rope for layer in fused._layers] == [1, 0, 1]  # local, global, local
    assert all(layer.attn_out_norm and layer.mlp_out_norm and layer.q_norm for layer in fused._layers)
    assert fused.dims.gelu == 1
    parts = fused.model.model.layers[0].self_attn.qkv_proj.impl.weight.parts
    assert [p.type for p in parts] == [Q.Q5_0, Q.Q5_0, Q.Q5_1]  # held as blocks, one part each


def test_gemma_one_call_declines_what_it_does_not_compute(gemma3: tuple[Path, Any]) -> None:
    """bf16 activations (Gemma's norms round once, after the scale) and Gemma 2's soft-capped
    attention keep the modules, each named."""
    out, _ = gemma3
    model: Any = runner_of(out).model
    assert why_not(model, torch.float32) is None
    assert "Gemma on torch.bfloat16 activations" in (why_not(model, torch.bfloat16) or "")
    layer = model.model.layers[0]
    layer.self_attn.attention = AttentionOptions(sliding_window=WINDOW, logit_softcap=50.0)
    assert "GemmaAttention's attention=" in (not_in_c(layer) or "")


def test_gemma3_greedy_matches_hf_float64(gemma3: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Served together (chunked prefill, mixed batches), prompts two to three windows long: every
    decode step of one-row and many-row batches in the one call, the tokens HF float64's."""
    out, model = gemma3
    runner = runner_of(out)
    fused = cpu_backend(runner).fused_decode
    assert isinstance(fused, FusedDecode)
    calls = count_calls(fused.kernels, "decode_layers", monkeypatch)
    prompts = [
        [(7 * i + 3 * n) % 300 + 3 for i in range(n)] for n in (2 * WINDOW + 3, 3 * WINDOW - 1, WINDOW + 9)
    ]
    new_tokens = 12
    ours, _ = inprocess.generate(
        runner, prompts, new_tokens, chunked_prefill_size=16, enable_mixed_chunk=False
    )
    assert len(calls) >= new_tokens - 1, "the decode steps did not run the one call"
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
        first_divergence_within_top2(model, prompt, got, ref[0, len(prompt) :].tolist())
