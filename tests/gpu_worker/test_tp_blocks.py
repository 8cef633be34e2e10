"""Tensor parallel over GGUF blocks (tensor_parallel.py): each rank's blocks are, dequantized, the
rank's share of the dense weights bit for bit, and a row-parallel split that cuts a block is refused
at start naming the tensor. (The ranks' greedy tokens against one rank's: tests/integration.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from gpu_worker import tensor_parallel as tp
from gpu_worker.models.layers import Linear
from gpu_worker.weights.loader import load_model
from tests.gguf_writer import write_gguf
from tests.gpu_worker.test_gguf_weights import KEEP, make_random_llama

Q = gguf.GGMLQuantizationType


def _load(hf_dir: Path, path: Path, keep: frozenset[int]) -> Any:
    model, _ = load_model(hf_dir, torch.float64, torch.device("cpu"), path, keep)
    return model


@pytest.mark.parametrize("rank", [0, 1])
def test_each_ranks_blocks_are_its_dense_share(tmp_path: Path, rank: int) -> None:
    hf_dir, path = make_random_llama(tmp_path)
    quant, dense = _load(hf_dir, path, KEEP), _load(hf_dir, path, frozenset())
    reduced = tp.shard(quant, rank, 2)
    tp.shard(dense, rank, 2)
    assert quant.tensor_parallel == (rank, 2) and len(reduced) == 2 * 2 + 1  # o, down per layer; head
    attn = quant.model.layers[0].self_attn
    assert [p.type for p in attn.qkv_proj.quantized.parts] == [Q.Q8_0, Q.Q4_1, Q.Q4_0]  # still one part each
    assert attn.num_heads == 2 and attn.num_kv_heads == 1
    dense_modules = dict(dense.named_modules())
    checked = 0
    for name, module in quant.named_modules():
        if isinstance(module, Linear) and module.quantized is not None:
            got = module.quantized.dequantize().double()
            assert torch.equal(got, dense_modules[name].weight), name
            checked += 1
    assert checked == 2 * 4 + 1
    # The embedding stays whole, the (tied) head has its vocabulary rows.
    assert quant.model.embed_tokens.quantized.rows == 320 and quant.lm_head.quantized.rows == 160


def test_a_split_that_cuts_a_block_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    """o_proj's 96 input columns over 2 ranks: 48 each, not whole Q8_0 blocks of 32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes: dict[str, Any] = dict(vocab_size=64, hidden_size=96, intermediate_size=128, num_hidden_layers=1)
    config = LlamaConfig(num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64, **sizes)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path)
    write_gguf(tmp_path / "model.gguf", model, {"attn_output": Q.Q8_0, "ffn_down": Q.Q8_0})
    quant = _load(tmp_path, tmp_path / "model.gguf", KEEP)
    with pytest.raises(
        ValueError, match=r"--tp-size 2 cannot split model\.layers\.0\.self_attn\.o_proj\.weight"
    ):
        tp.shard(quant, 0, 2)
