"""Random Llamas whose Linears are Q5_0, Q5_1, IQ4_NL and IQ4_XS (csrc/quant_sub32.c), or F16 and BF16
(csrc/quant_f16.c), beside other types in the same merged Linear, through the real loader: held as
blocks (none dequantized or widened at load), answering as the dequantized twin does, and decoding in
the one call bit for bit as the modules do."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from gpu_worker.backends.cpu.layouts import X8_LAYOUT
from gpu_worker.backends.cpu.quant import QuantEmbedding, QuantLinear
from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from tests.gpu_worker.helpers import GREEDY, MiniScheduler
from tests.gpu_worker.test_decode_layers import assert_one_call_equals_the_modules, cpu_backend, runner_of
from tests.gpu_worker.test_gguf_weights import Q, make_random_llama

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

# q/k/v of three types (two of the new ones, v in IQ4_NL), gate/up a legacy Q4_0 beside Q5_0 (both
# held interleaved), down in IQ4_XS (its 256 inputs one super-block), the tied
# embedding IQ4_NL (looked up and the head, one table).
TYPES = {
    "attn_q": Q.Q5_0,
    "attn_k": Q.Q5_1,
    "attn_v": Q.IQ4_NL,
    "attn_output": Q.Q5_1,
    "ffn_gate": Q.Q4_0,
    "ffn_up": Q.Q5_0,
    "ffn_down": Q.IQ4_XS,
    "token_embd": Q.IQ4_NL,
}
# 16-bit weights beside a Q5_0 v and a Q4_0 up; the tied embedding F16.
SIXTEEN_BIT = {
    "attn_q": Q.BF16,
    "attn_k": Q.F16,
    "attn_v": Q.Q5_0,
    "attn_output": Q.BF16,
    "ffn_gate": Q.F16,
    "ffn_up": Q.Q4_0,
    "ffn_down": Q.BF16,
    "token_embd": Q.F16,
}
# Q3_K's down (its 256 inputs one block, held interleaved; written as random blocks:
# tests/block_quants.py) beside legacy and sub-32 types.
K23 = TYPES | {"attn_v": Q.Q8_0, "attn_output": Q.Q4_1, "ffn_down": Q.Q3_K, "token_embd": Q.Q8_0}
MAPS = {"sub32": TYPES, "sixteen_bit": SIXTEEN_BIT, "k23": K23}


@pytest.fixture(scope="module", params=list(MAPS))
def sub32_llama(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    return make_random_llama(tmp_path_factory.mktemp(f"{request.param}-llama"), MAPS[request.param])


def test_held_as_blocks(sub32_llama: tuple[Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    """Every Linear and the embedding on their file's blocks, each part of its type; nothing
    dequantized at load, and the start log's matmul paths name the blocks."""
    with caplog.at_level(logging.INFO):
        runner = runner_of(sub32_llama, "float32")
    assert "dequantized at load" not in caplog.text
    layer = runner.model.model.layers[0]  # type: ignore[attr-defined]
    held = {
        "qkv": layer.self_attn.qkv_proj.impl,
        "o": layer.self_attn.o_proj.impl,
        "gate_up": layer.mlp.gate_up_proj.impl,
        "down": layer.mlp.down_proj.impl,
    }
    assert all(isinstance(impl, QuantLinear) for impl in held.values())
    types = {name: [p.type for p in impl.weight.parts] for name, impl in held.items()}
    want = next(
        m for m in MAPS.values() if [m["attn_output"]] == types["o"] and [m["ffn_down"]] == types["down"]
    )
    assert types == {
        "qkv": [want["attn_q"], want["attn_k"], want["attn_v"]],
        "o": [want["attn_output"]],
        "gate_up": [want["ffn_gate"], want["ffn_up"]],
        "down": [want["ffn_down"]],
    }
    # (the rest as in the file)
    interleaved = {Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.IQ4_XS, Q.Q3_K}
    for impl in held.values():
        assert [p.layout == X8_LAYOUT for p in impl.weight.parts] == [
            p.type in interleaved for p in impl.weight.parts
        ]
    embedding = runner.model.model.embed_tokens.impl  # type: ignore[attr-defined]
    assert isinstance(embedding, QuantEmbedding) and embedding.table.type == want["token_embd"]
    assert "weights held" in caplog.text


def _last_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    batch = MiniScheduler(runner.num_pages, runner.config.page_size).batch([(0, 0, prompt, True, GREEDY)])
    return runner.compute_logits(batch)[0].double()


@pytest.mark.parametrize("dense_min_rows", [1 << 30, 1], ids=["integer", "dense"])
def test_answers_as_the_dequantized_twin(sub32_llama: tuple[Path, Path], dense_min_rows: int) -> None:
    """The prompt's logits within 1.5% of their spread of the float64 model holding the blocks'
    values (test_gguf_weights.py says why that bound), on the integer and on the dense path."""
    hf_dir, _ = sub32_llama
    prompt = list(range(3, 300, 7))
    runner = runner_of(sub32_llama, "float32")
    for module in runner.model.modules():  # type: ignore[attr-defined]
        impl = getattr(module, "impl", None)
        if isinstance(impl, QuantLinear):
            impl.dense_min_rows = [dense_min_rows] * len(impl.dense_min_rows)
    got = _last_logits(runner, prompt)
    ref = _last_logits(
        ModelRunner(WorkerConfig(model_path=str(hf_dir), dtype="float64", kv_cache_tokens=512)), prompt
    )
    spread = float(ref.max() - ref.min())
    assert float((got - ref).abs().max()) <= 0.015 * spread, (float((got - ref).abs().max()), spread)
    assert int(got.argmax()) in set(torch.topk(ref, 2).indices.tolist())


@pytest.mark.parametrize("rows", [1, 3])
def test_one_call_decode_equals_the_modules(
    sub32_llama: tuple[Path, Path], rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Merged Linears whose parts mix the new types with legacy ones stay in the one-call decode."""
    runner = runner_of(sub32_llama, "float32")
    assert cpu_backend(runner).fused_decode is not None
    assert_one_call_equals_the_modules(runner, rows, monkeypatch)
