"""gpt-oss in the one-call decode (csrc/decode_layers.c, backends/cpu/decode_gpt_oss.py): sinks, the
alternating window, biases on q/k/v and o, the biased top-k router and the clamped experts on MXFP4
blocks give the modules' logits bit for bit; Qwen2's q/k/v biases ride the same path."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from gpu_worker.backends.cpu.clamped_experts import TopKRouter
from gpu_worker.models.gpt_oss import SinkDecoderLayer, TopKSoftmaxMoeBlock
from gpu_worker.weights.model_files import resolve_model
from tests.exactness.test_gpt_oss import hf_gpt_oss, tiny_gpt_oss_config
from tests.gguf_writer import write_gguf
from tests.gpt_oss_gguf import gpt_oss_metadata, gpt_oss_tensors
from tests.gpu_worker.test_decode_layers import assert_one_call_equals_the_modules, cpu_backend, runner_of

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler to build the kernels"
)

Q = gguf.GGMLQuantizationType
# As the bench's gpt-oss file (llama.cpp's converter's): q/k/v in BF16, the experts in MXFP4, the
# router and the biases F32; o in Q8_0 here, so two block types meet the biases.
GPT_OSS_TYPES = {"attn_q": Q.BF16, "attn_k": Q.BF16, "attn_v": Q.BF16, "attn_output": Q.Q8_0}


def write_gpt_oss(path: Path, model: Any) -> None:
    """``model`` as a gpt-oss GGUF, its Linears in ``GPT_OSS_TYPES`` and its experts in MXFP4."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    gpt_oss_metadata(writer, cfg)
    for name, data in gpt_oss_tensors(model.state_dict(), cfg.num_hidden_layers).items():
        kind = name.split(".")[-2] if name.endswith(".weight") else None
        qtype = Q.MXFP4 if name.endswith("_exps.weight") else GPT_OSS_TYPES.get(kind or "")
        if qtype is None:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gpt_oss_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(HF dir converted from the GGUF, the GGUF) of a 2-layer gpt-oss (a sliding and a full layer)
    whose every bias is non-zero."""
    out = tmp_path_factory.mktemp("gpt_oss_one_call")
    model = hf_gpt_oss(tiny_gpt_oss_config(layers=2, swiglu_limit=7.0), seed=5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):  # q/k/v/o's and the router's too (zero from HF's init)
                param.copy_(torch.randn_like(param) * 0.5)
    path = out / "model.gguf"
    write_gpt_oss(path, model)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RIVULET_CACHE_DIR", str(out / "cache"))
        return resolve_model(str(path)), path


@pytest.mark.parametrize(
    ("dtype", "rows"),
    [("float32", 1), ("float32", 3), ("float32", 9), ("bfloat16", 3)],
    ids=["f32-1row", "f32-3rows", "f32-9rows_dense", "bf16-3rows"],
)
def test_gpt_oss_one_call_equals_the_modules(
    gpt_oss_gguf: tuple[Path, Path], dtype: str, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts past the window (8) on the sliding layer, then decode steps: the one call's logits
    are the modules', bit for bit, with every layer's sinks, biases, router and clamped experts."""
    runner = runner_of(gpt_oss_gguf, dtype)
    model: Any = runner.model
    layers = list(model.model.layers)
    assert all(isinstance(layer, SinkDecoderLayer) for layer in layers)
    assert [layer.attention.sliding_window for layer in layers] == [8, 0]
    assert all(isinstance(layer.mlp, TopKSoftmaxMoeBlock) for layer in layers)
    assert all(isinstance(layer.mlp.router, TopKRouter) for layer in layers)
    assert all(layer.self_attn.qkv_proj.impl.bias is not None for layer in layers)
    assert_one_call_equals_the_modules(runner, rows, monkeypatch)


def test_top_k_router_routes_as_the_torch_code(gpt_oss_gguf: tuple[Path, Path]) -> None:
    """The C router (moe_route_topk) picks the experts the block's torch code picks (the biased
    logits' top k), weighted by the softmax of those k, to float32's rounding."""
    runner = runner_of(gpt_oss_gguf, "float32")
    block: Any = runner.model.model.layers[0].mlp  # type: ignore[attr-defined]
    router = block.router
    assert isinstance(router, TopKRouter)
    x = torch.randn(37, router.weight.shape[1], generator=torch.Generator().manual_seed(3))
    ids, weights = router(x)
    logits = x.double() @ router.weight.double().T + router.bias.double()
    top, want_ids = torch.topk(logits, block.top_k, dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights.double(), torch.softmax(top, dim=-1), rtol=0, atol=1e-6)
    assert float(router.bias.abs().max()) > 0.1, "the bias must count"


@pytest.fixture(scope="module")
def qwen2_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(HF dir, GGUF) of a 2-layer Qwen2 (q/k/v biases, non-zero), its Linears in Q8_0 and Q4_0."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("qwen2_one_call")
    config = Qwen2Config(
        vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn_like(param) * 0.5)
    types = {"attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "attn_v": Q.Q4_0, "attn_output": Q.Q8_0,
             "ffn_gate": Q.Q4_0, "ffn_up": Q.Q4_0, "ffn_down": Q.Q8_0, "token_embd": Q.Q8_0}  # fmt: skip
    held = write_gguf(out / "model.gguf", model, types)
    model.load_state_dict(held, strict=False)
    model.save_pretrained(out, safe_serialization=True)
    return out, out / "model.gguf"


def test_qwen2_biases_run_in_the_one_call(
    qwen2_gguf: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen2's q/k/v biases (o and the MLP have none) added in the one call as QuantLinear adds them."""
    runner = runner_of(qwen2_gguf, "float32")
    attn: Any = runner.model.model.layers[0].self_attn  # type: ignore[attr-defined]
    assert attn.qkv_proj.impl.bias is not None and attn.o_proj.bias is None
    assert cpu_backend(runner).fused_decode is not None
    assert_one_call_equals_the_modules(runner, 3, monkeypatch)
