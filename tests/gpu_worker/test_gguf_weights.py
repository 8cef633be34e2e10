"""GGUF weights loaded in their quantized blocks: names, the Q/K row permutation, the loader's
strictness, and a random Llama written to GGUF by the test running through the real loader.

The quantized forward is compared with the same GGUF dequantized (float64): the blocks are the
same numbers, so the one difference is the kernels' int8 rounding of activations (each value
within half a step of its block's scale, absmax / 127), which moves a logit by a fraction of a percent of
its spread at most (0.27% measured in float32, 0.48% in bfloat16, which rounds too); the bound
below, 1.5%, leaves room for the 2 layers it passes through and fails on any wrong block or row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gpu_worker.backends.cpu.backend import auto_dtype
from gpu_worker.backends.cpu.layouts import X8_LAYOUT
from gpu_worker.backends.cpu.quant import QuantLinear
from gpu_worker.config import WorkerConfig
from gpu_worker.model_runner import ModelRunner
from gpu_worker.models.layers import Embedding, Linear
from gpu_worker.weights.formats import QuantizedWeight
from gpu_worker.weights.gguf_names import GgufError, hf_name, unpermute_rows
from gpu_worker.weights.loader import WeightMismatchError, load_model
from tests.block_quants import quantize
from tests.gpu_worker.helpers import GREEDY, MiniScheduler

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# The GGUF type each Llama weight is written in: a merged projection of three types (q/k/v), one
# of a single type (gate/up), the tied embedding in Q8_0 as the embedded model has it.
TYPES = {
    "attn_q": Q.Q8_0,
    "attn_k": Q.Q4_1,
    "attn_v": Q.Q4_0,
    "attn_output": Q.Q4_1,
    "ffn_gate": Q.Q4_1,
    "ffn_up": Q.Q4_1,
    "ffn_down": Q.Q8_0,
    "token_embd": Q.Q8_0,
}
HEADS, KV_HEADS = 4, 2


def llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows (pairs rotary dims i and i + D/2)."""
    return (
        rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def test_unpermute_undoes_the_converter_by_whole_rows() -> None:
    rows = np.arange(8 * 6 * 3, dtype=np.float32).reshape(8 * 6, 3)
    assert np.array_equal(unpermute_rows(llama_cpp_permute(rows, 8), 8), rows)
    # On quantized rows: the blocks of each row move together and dequantize to the original rows.
    weights = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    blocks = gguf.quants.quantize(llama_cpp_permute(weights, 2), Q.Q4_1)
    direct = gguf.quants.dequantize(gguf.quants.quantize(weights, Q.Q4_1), Q.Q4_1)
    assert np.array_equal(gguf.quants.dequantize(unpermute_rows(blocks, 2), Q.Q4_1), direct)


def test_tensor_names_map_to_the_checkpoints() -> None:
    assert hf_name("blk.1.ffn_norm.weight", "gemma2") == "model.layers.1.pre_feedforward_layernorm.weight"
    assert (
        hf_name("blk.1.post_ffw_norm.weight", "gemma3") == "model.layers.1.post_feedforward_layernorm.weight"
    )
    assert hf_name("blk.0.attn_qkv.weight", "phi3") == "model.layers.0.self_attn.qkv_proj.weight"
    assert hf_name("blk.0.ffn_up.weight", "phi3") == "model.layers.0.mlp.gate_up_proj.weight"
    assert hf_name("rope_factors_long.weight", "phi3") is None
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("rope_freqs.weight") is None
    assert hf_name("blk.1.attn_qkv.weight", "gpt2") == "transformer.h.1.attn.c_attn.weight"
    assert hf_name("blk.0.ffn_down.bias", "gpt2") == "transformer.h.0.mlp.c_proj.bias"
    assert hf_name("position_embd.weight", "gpt2") == "transformer.wpe.weight"
    assert hf_name("output_norm.bias", "gpt2") == "transformer.ln_f.bias"
    with pytest.raises(GgufError, match="blk.0.ssm_a"):
        hf_name("blk.0.ssm_a.weight")


def _gguf_name(hf: str) -> str:
    for gguf_name in _all_gguf_names(2):
        if hf_name(gguf_name) == hf:
            return gguf_name
    raise KeyError(hf)


def _all_gguf_names(layers: int) -> list[str]:
    per_layer = [
        "attn_norm",
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_norm",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    ]
    names = ["token_embd.weight", "output_norm.weight"]
    return names + [f"blk.{i}.{t}.weight" for i in range(layers) for t in per_layer]


def write_gguf(
    path: Path, state: dict[str, torch.Tensor], skip: tuple[str, ...] = (), types: dict[str, Any] = TYPES
) -> dict[str, torch.Tensor]:
    """The checkpoint as a llama.cpp GGUF (Q/K rows permuted, weights in ``types``, norms F32);
    returns the checkpoint as the file holds it (each weight its blocks dequantized)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    held = {}
    for name, tensor in state.items():
        if name == "lm_head.weight" or name in skip:
            continue  # tied: the file holds the embedding once
        gguf_name = _gguf_name(name)
        data = tensor.float().numpy()
        heads = HEADS if ".attn_q." in gguf_name else KV_HEADS if ".attn_k." in gguf_name else None
        if heads is not None:
            data = llama_cpp_permute(data, heads)
        kind = gguf_name.split(".")[-2]
        if kind in types:
            blocks = quantize(data, types[kind])  # gguf-py's, or ours where it has none (IQ4)
            writer.add_tensor(gguf_name, blocks, raw_dtype=types[kind])
            data = gguf.quants.dequantize(blocks, types[kind])
        else:
            writer.add_tensor(gguf_name, data)
        held[name] = torch.from_numpy(unpermute_rows(data, heads) if heads is not None else data.copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def make_random_llama(out: Path, types: dict[str, Any] = TYPES, intermediate: int = 256) -> tuple[Path, Path]:
    """(HF dir, GGUF file) of one random 2-layer Llama in ``out``: the GGUF written by
    ``write_gguf``, the HF dir holding the GGUF's weights dequantized (as a GGUF's conversion does)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=320, hidden_size=128, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    held = write_gguf(out / "model.gguf", model.state_dict(), types=types)
    model.load_state_dict(held, strict=False)
    model.save_pretrained(out, safe_serialization=True)
    return out, out / "model.gguf"


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_random_llama(tmp_path_factory.mktemp("gguf-llama"))


KEEP = frozenset({int(Q.Q4_0), int(Q.Q4_1), int(Q.Q8_0)})


def test_random_llama_loads_with_its_blocks_kept(random_llama: tuple[Path, Path]) -> None:
    hf_dir, path = random_llama
    quant, _ = load_model(hf_dir, torch.float64, torch.device("cpu"), path, KEEP)
    dense, _ = load_model(hf_dir, torch.float64, torch.device("cpu"), path, frozenset())
    attn = quant.model.layers[0].self_attn  # type: ignore[attr-defined]
    mlp = quant.model.layers[0].mlp  # type: ignore[attr-defined]
    assert [p.type for p in attn.qkv_proj.quantized.parts] == [Q.Q8_0, Q.Q4_1, Q.Q4_0]  # three types
    assert [p.type for p in mlp.gate_up_proj.quantized.parts] == [Q.Q4_1]  # one type: merged rows
    assert quant.lm_head.quantized is quant.model.embed_tokens.quantized  # type: ignore[attr-defined]
    dense_modules = dict(dense.named_modules())  # type: ignore[attr-defined]
    checked = 0
    for name, module in quant.named_modules():  # type: ignore[attr-defined]
        if isinstance(module, Linear | Embedding):
            weight = module.quantized
            assert isinstance(weight, QuantizedWeight), f"{name} was not kept quantized"
            assert module.weight.numel() == 0, f"{name} still holds a dense weight"
            assert torch.equal(weight.dequantize().double(), dense_modules[name].weight), name
            checked += 1
    assert checked == 2 * 4 + 2  # per layer qkv, o, gate_up, down; the embedding and tied head
    # The norms came in dense and exact.
    assert torch.equal(quant.model.norm.weight, dense.model.norm.weight)  # type: ignore[attr-defined]


def test_missing_tensor_is_refused(random_llama: tuple[Path, Path], tmp_path: Path) -> None:
    hf_dir, _ = random_llama
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(hf_dir).state_dict()
    write_gguf(tmp_path / "short.gguf", state, skip=("model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(WeightMismatchError, match=r"layers\.1\.mlp\.up_proj"):
        load_model(hf_dir, torch.float32, torch.device("cpu"), tmp_path / "short.gguf", KEEP)


def _last_logits(config: WorkerConfig, prompt: list[int], dense_min_rows: int | None = None) -> torch.Tensor:
    """Logits after ``prompt`` (one prefill) by a runner of ``config``; ``dense_min_rows`` set on
    every quantized Linear when given (which path its row counts take)."""
    runner = ModelRunner(config)
    if dense_min_rows is not None:
        impls = [m.impl for m in runner.model.modules() if isinstance(getattr(m, "impl", None), QuantLinear)]  # type: ignore[attr-defined]
        assert impls
        held = [part for impl in impls for part in impl.weight.parts]
        assert all(part.layout == X8_LAYOUT for part in held), "the legacy types are held interleaved by 8"
        embedding = runner.model.model.embed_tokens.impl  # type: ignore[attr-defined]
        assert embedding.table.layout == X8_LAYOUT and any(embedding.table is p for p in held), (
            "tied: one table"
        )
        for impl in impls:
            impl.dense_min_rows = [dense_min_rows] * len(impl.dense_min_rows)
    batch = MiniScheduler(runner.num_pages, config.page_size).batch([(0, 0, prompt, True, GREEDY)])
    return runner.compute_logits(batch)[0].double()


@pytest.mark.parametrize("dense_min_rows", [1 << 30, 1], ids=["integer", "dense"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_forward_matches_the_dequantized_gguf(
    random_llama: tuple[Path, Path], dtype: str, dense_min_rows: int | None
) -> None:
    hf_dir, path = random_llama
    prompt = list(range(3, 300, 7))
    got = _last_logits(
        WorkerConfig(
            model_path=str(hf_dir), gguf_path=str(path), weight_dtype="gguf", dtype=dtype, kv_cache_tokens=512
        ),
        prompt,
        dense_min_rows,
    )
    ref = _last_logits(WorkerConfig(model_path=str(hf_dir), dtype="float64", kv_cache_tokens=512), prompt)
    spread = float(ref.max() - ref.min())  # measured: fp32 0.27% of it, bf16 0.48%
    assert float((got - ref).abs().max()) <= 0.015 * spread, (float((got - ref).abs().max()), spread)
    assert int(got.argmax()) in set(torch.topk(ref, 2).indices.tolist())


def test_weight_dtype_gguf_refuses_what_it_cannot_run(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="--weight-dtype gguf: the model is not a GGUF file"):
        ModelRunner(WorkerConfig(model_path=str(tiny_llama_dir), weight_dtype="gguf", kv_cache_tokens=64))


def test_weight_dtype_is_checked() -> None:
    with pytest.raises(AssertionError, match="weight_dtype"):
        WorkerConfig(weight_dtype="int4")


def test_header_reader_matches_gguf_reader(random_llama: tuple[Path, Path]) -> None:
    """gguf_file.py's header (our fast reader) and gguf's own reader agree on every tensor and on
    the metadata, the embedded model's 49k-token vocabulary included."""
    from gpu_worker.weights.gguf_file import TOKENIZER_ARRAYS, read_header
    from gpu_worker.weights.gguf_weights import _tensor_data
    from gpu_worker.weights.model_files import embedded_gguf_path

    _, path = random_llama
    for file in (path, embedded_gguf_path()):
        header = read_header(file, TOKENIZER_ARRAYS)
        reader = gguf.GGUFReader(str(file))
        assert header.architecture == "llama"
        assert [(e.name, e.type, e.offset, e.nbytes) for e in header.tensors] == [
            (t.name, int(t.tensor_type), int(t.data_offset), int(t.n_bytes)) for t in reader.tensors
        ]
        mapped = np.memmap(file, dtype=np.uint8, mode="r")
        for entry, tensor in zip(header.tensors[:12], reader.tensors[:12], strict=True):
            got = _tensor_data(mapped, entry)
            assert np.array_equal(got, tensor.data.reshape(got.shape)), entry.name
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            want = field.contents()
            got = header.metadata[key]
            if isinstance(want, float):
                assert got == pytest.approx(want, rel=1e-7), key
            elif (
                key in TOKENIZER_ARRAYS
                or not isinstance(want, list)
                or not want
                or not isinstance(want[0], str)
            ):
                assert got == want, key
            else:  # string arrays not asked for: their count
                assert got == len(want), key


def test_auto_dtype_is_float32_over_gguf_blocks(random_llama: tuple[Path, Path]) -> None:
    """--dtype auto: float32 activations where the weights stay in blocks (a near-tie of the embedded
    model's answer flips under bf16 ones: gpu_worker/backends/cpu/backend.py), the kind's choice where not."""
    hf_dir, path = random_llama
    kept = ModelRunner(WorkerConfig(model_path=str(hf_dir), gguf_path=str(path), kv_cache_tokens=64))
    assert kept.dtype == torch.float32
    assert any(isinstance(getattr(m, "impl", None), QuantLinear) for m in kept.model.modules())  # type: ignore[attr-defined]
    dequantized = ModelRunner(
        WorkerConfig(model_path=str(hf_dir), gguf_path=str(path), weight_dtype="float32", kv_cache_tokens=64)
    )
    assert dequantized.dtype == getattr(torch, auto_dtype())  # the kind's choice
