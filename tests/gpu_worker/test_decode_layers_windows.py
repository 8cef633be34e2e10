"""Sliding-window layers in the one-call decode (csrc/decode_layers.c): a Mistral with a window on
every layer and a Qwen3 whose layers alternate windowed and full, on GGUF blocks, prompts longer than
the window. The one call runs their decode steps, equal to the modules' bit for bit, and their greedy
tokens are HF float64's on the file's own weights (or near-tied there, as the 8-bit activations allow)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.backends.cpu.backend import CpuBackend
from gpu_worker.backends.cpu.decode_layers import FusedDecode, not_in_c
from gpu_worker.config import WorkerConfig
from gpu_worker.forward_context import AttentionOptions
from gpu_worker.model_runner import ModelRunner
from tests.block_quants import Q
from tests.exactness import inprocess
from tests.exactness.test_smollm2_bf16 import first_divergence_within_top2
from tests.gguf_writer import write_gguf
from tests.gpu_worker.test_decode_layers import assert_one_call_equals_the_modules, cpu_backend
from tests.models import WINDOW, tiny_config

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

KINDS = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd"}
TYPES = dict.fromkeys(KINDS, Q.Q8_0)
# Each kind's windows per layer, as the runner's layers must carry them into the one call.
WINDOWS = {"mistral_window": (WINDOW, WINDOW), "qwen3_pattern": (WINDOW, 0)}


def window_config(kind: str) -> Any:
    """Mistral's window on every layer, or Qwen3's per-layer pattern (the first layer slides)."""
    if kind == "mistral_window":
        return tiny_config(kind, tie=True)
    cfg = tiny_config("qwen3", tie=True)
    cfg.use_sliding_window, cfg.sliding_window = True, WINDOW
    cfg.layer_types = ["sliding_attention", "full_attention"]
    return cfg


@pytest.fixture(scope="module", params=sorted(WINDOWS))
def windowed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """(dir holding the HF checkpoint and its GGUF, HF float64 model of the file's weights)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(window_config(request.param)).double().eval()
    model.generation_config.eos_token_id = None  # the runner stops at no token either
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
def test_windowed_layers_equal_the_modules(
    windowed: tuple[Path, Any], rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts past the window, 20 decode steps each by the one call and by the modules: equal
    logits; each layer's window is the one the call was given."""
    out, model = windowed
    runner = runner_of(out)
    assert_one_call_equals_the_modules(runner, rows, monkeypatch)
    fused = cpu_backend(runner).fused_decode
    assert isinstance(fused, FusedDecode) and fused._layers is not None
    kind = out.name.rstrip("0123456789")
    assert tuple(layer.window for layer in fused._layers) == WINDOWS[kind]
    if kind == "mistral_window" and rows == 3:  # bf16 too (Qwen3's Q/K norms keep bf16 on the modules)
        assert_one_call_equals_the_modules(runner_of(out, "bfloat16"), rows, monkeypatch)


@pytest.mark.parametrize(
    "options",
    [
        AttentionOptions(sliding_window=WINDOW, logit_softcap=50.0),
        AttentionOptions(sliding_window=WINDOW, scale=0.1),
        AttentionOptions(sinks=torch.zeros(4)),
    ],
    ids=["softcap", "scale", "sinks"],
)
def test_a_window_with_other_options_keeps_the_modules(
    windowed: tuple[Path, Any], options: AttentionOptions
) -> None:
    """The positive list admits a window and nothing beside it: a soft-cap, a scale or sinks on a
    layer (Gemma 2's, gpt-oss's) name that layer as the reason to run the modules."""
    out, _ = windowed
    layer = cpu_backend(runner_of(out)).fused_decode.model.model.layers[0]  # type: ignore[union-attr]
    assert not_in_c(layer) is None
    layer.attention = options
    assert "DecoderLayer's attention=" in (not_in_c(layer) or "")


def test_windowed_greedy_matches_hf_float64(
    windowed: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Served together (chunked prefill, mixed batches), prompts two to three windows long: every
    decode step of one-row and many-row batches in the one call, the tokens HF float64's."""
    out, model = windowed
    runner = runner_of(out)
    backend = cpu_backend(runner)
    assert isinstance(backend, CpuBackend) and isinstance(backend.fused_decode, FusedDecode)
    calls: list[int] = []
    original = backend.fused_decode.kernels.decode_layers

    def counted(*args: Any) -> None:
        calls.append(1)
        original(*args)

    monkeypatch.setattr(backend.fused_decode.kernels, "decode_layers", counted)
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
