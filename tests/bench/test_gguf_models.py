"""bench/lib/gguf_models.py on a small shape: llama.cpp's Q4_K_M mix, sane random weights, the embedded
GGUF's tokenizer fields, and bench model names resolved to made files."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest

from bench.lib import gguf_models
from bench.lib.gguf_models import Q, Shape
from gpu_worker.weights.model_files import embedded_gguf_path

SMALL = Shape("small", hidden=256, layers=16, heads=4, kv_heads=2, ffn=512)


def test_more_bits_layers_are_llama_cpps() -> None:
    """The first and last eighth, and every third between: 8 of 16 layers."""
    layers = [i for i in range(16) if gguf_models.more_bits(i, 16)]
    assert layers == [0, 1, 4, 7, 10, 13, 14, 15]


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> gguf.GGUFReader:
    path = gguf_models.write_model(tmp_path_factory.mktemp("bench-gguf") / "m.gguf", SMALL, "q4_k_m")
    return gguf.GGUFReader(str(path))


def test_q4_k_m_mix_and_weights(q4_k_m: gguf.GGUFReader) -> None:
    types = {t.name: Q(t.tensor_type) for t in q4_k_m.tensors}
    assert types["token_embd.weight"] == Q.Q6_K and "output.weight" not in types  # tied
    for i in range(16):
        wide = Q.Q6_K if gguf_models.more_bits(i, 16) else Q.Q4_K
        assert types[f"blk.{i}.attn_v.weight"] == types[f"blk.{i}.ffn_down.weight"] == wide, i
        for role in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{role}.weight"] == Q.Q4_K, (i, role)
        assert types[f"blk.{i}.attn_norm.weight"] == Q.F32
    for t in q4_k_m.tensors:
        if t.name.startswith(("blk.0.", "blk.2.", "token_embd")) and Q(t.tensor_type) != Q.F32:
            w = gguf.quants.dequantize(t.data[:64], t.tensor_type)
            assert np.isfinite(w).all() and abs(float(w.mean())) < 2e-3, t.name
            assert 0.015 < float(w.std()) < 0.025, (t.name, float(w.std()))
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in q4_k_m.tensors}
    assert shapes["blk.3.attn_k.weight"] == (256, 128) and shapes["blk.3.ffn_down.weight"] == (512, 256)


def test_tokenizer_fields_are_the_embedded_ggufs(q4_k_m: gguf.GGUFReader) -> None:
    embedded = gguf.GGUFReader(str(embedded_gguf_path()))
    keys = [k for k in embedded.fields if k.startswith("tokenizer.")]
    assert "tokenizer.ggml.tokens" in keys
    for key in keys:
        assert q4_k_m.fields[key].contents() == embedded.fields[key].contents(), key
    assert q4_k_m.fields["llama.attention.head_count_kv"].contents() == 2


RANDOM_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
RANDOM_TYPES += [Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.IQ4_XS, Q.BF16, Q.F16, Q.Q2_K, Q.Q3_K]


@pytest.mark.parametrize("qtype", RANDOM_TYPES, ids=lambda q: q.name)
def test_random_blocks_have_the_asked_spread(qtype: Q) -> None:
    blocks = gguf_models.random_blocks(qtype, 16, 1024, np.random.default_rng(1), std=0.05)
    w = gguf.quants.dequantize(blocks, qtype)
    # (Q4_0's and Q6_K's quants are centred half a step low: d (q - 8), q in [0, 16))
    assert w.shape == (16, 1024) and abs(float(w.mean())) < 6e-3 and 0.04 < float(w.std()) < 0.06


def _types(shape: Shape, file_type: str) -> dict[str, Q]:
    return {name: qtype for name, qtype, _ in gguf_models._tensors(shape, file_type) if qtype is not None}


def test_gemma3_270m_q4_k_m_falls_back_as_llama_quantize() -> None:
    """640-wide rows are not whole super-blocks: q/k/gate/up Q5_0, v Q5_0 or (more bits) Q8_0, the
    embedding Q8_0; o (1024 wide) and down (2048) stay K-quants."""
    types = _types(gguf_models.GEMMA3_270M, "q4_k_m")
    assert types["token_embd.weight"] == Q.Q8_0
    for i in range(18):
        more = gguf_models.more_bits(i, 18)
        for role in ("attn_q", "attn_k", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{role}.weight"] == Q.Q5_0
        assert types[f"blk.{i}.attn_v.weight"] == (Q.Q8_0 if more else Q.Q5_0)
        assert types[f"blk.{i}.attn_output.weight"] == Q.Q4_K
        assert types[f"blk.{i}.ffn_down.weight"] == (Q.Q6_K if more else Q.Q4_K)


def test_new_file_types_mix() -> None:
    """``mixed``: q/k/v/o in the fallbacks, the MLP Q4_K_M's; IQ4 files: v (8 query heads a KV head
    here) and the first eighth's down in Q5_K; BF16 / F16 files: every weight."""
    mixed = _types(gguf_models.LLAMA_1B, "mixed")
    assert mixed["blk.0.attn_q.weight"] == Q.Q5_0 and mixed["blk.0.attn_v.weight"] == Q.Q8_0
    assert mixed["blk.2.attn_v.weight"] == Q.Q5_0 and mixed["blk.2.ffn_gate.weight"] == Q.Q4_K
    assert mixed["blk.0.ffn_down.weight"] == Q.Q6_K and mixed["token_embd.weight"] == Q.Q6_K
    iq4 = _types(gguf_models.LLAMA_1B, "iq4_xs")
    assert iq4["blk.5.attn_v.weight"] == Q.Q5_K and iq4["blk.0.ffn_down.weight"] == Q.Q5_K
    assert iq4["blk.5.ffn_down.weight"] == iq4["blk.5.attn_q.weight"] == Q.IQ4_XS
    assert set(_types(gguf_models.LLAMA_1B, "bf16").values()) == {Q.BF16}
    q3 = _types(gguf_models.LLAMA_1B, "q3_k_m")
    assert [q3[f"blk.{i}.attn_v.weight"] for i in (0, 1, 2)] == [Q.Q5_K, Q.Q5_K, Q.Q4_K]
    assert q3["blk.0.ffn_down.weight"] == Q.Q5_K and q3["blk.1.ffn_down.weight"] == Q.Q4_K
    assert q3["blk.3.attn_output.weight"] == Q.Q4_K and q3["blk.3.ffn_up.weight"] == Q.Q3_K
    q2 = _types(gguf_models.LLAMA_1B, "q2_k")
    assert q2["blk.3.attn_v.weight"] == Q.Q4_K and q2["blk.3.ffn_down.weight"] == Q.Q3_K
    assert q2["blk.3.attn_output.weight"] == Q.Q3_K and q2["blk.3.attn_q.weight"] == Q.Q2_K
    assert q2["token_embd.weight"] == Q.Q6_K


def test_a_larger_vocabulary_pads_the_tokens(tmp_path: Path) -> None:
    """A Gemma-shaped file (fewer layers) with more tokens than SmolLM2's: its tokens padded with unused
    ones to the embedding's rows (llama.cpp checks them), the window in its fields."""
    shape = dataclasses.replace(gguf_models.GEMMA3_270M, name="g", layers=2, vocab=49160, ffn=256)
    reader = gguf.GGUFReader(str(gguf_models.write_model(tmp_path / "g.gguf", shape, "q4_k_m")))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == 49160 and tokens[-1] == "<unused49159>"
    assert reader.fields["tokenizer.ggml.token_type"].contents()[-1] == 5
    assert reader.fields["gemma3.attention.sliding_window"].contents() == 512
    assert {t.name: Q(t.tensor_type) for t in reader.tensors}["blk.1.ffn_up.weight"] == Q.Q5_0


@pytest.mark.parametrize(
    ("name", "shape", "file_name"),
    [
        ("llama1b-q4_k_m", gguf_models.LLAMA_1B, "llama1b-shape-q4_k_m-v1.gguf"),
        ("qwen3moe30b-q4_k_m", gguf_models.QWEN3_MOE_30B, "qwen3moe30b-shape-q4_k_m-v1.gguf"),
    ],
)
def test_names_resolve_to_made_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, shape: Shape, file_name: str
) -> None:
    made: list[tuple[Shape, str]] = []

    def fake_write(path: Path, shape: Shape, file_type: str) -> Path:
        made.append((shape, file_type))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"GGUF")
        return path

    monkeypatch.setenv("RIVULET_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gguf_models, "write_model", fake_write)
    path = gguf_models.resolve(name)
    assert path is not None and Path(path).is_file() and Path(path).name == file_name
    assert made == [(shape, "q4_k_m")]
    assert gguf_models.resolve(name) == path and len(made) == 1  # made once
    assert gguf_models.resolve(None) is None and gguf_models.resolve(str(tmp_path)) == str(tmp_path)
    bad = name.replace("q4_k_m", "q1_k")
    with pytest.raises(ValueError, match="no bench model"):
        gguf_models.resolve(bad)
