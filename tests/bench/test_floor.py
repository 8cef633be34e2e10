"""bench/lib/floor.py: the weight bytes a one-row decode step reads, from real GGUF files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from bench.lib.floor import decode_bytes, floor_x, read_bandwidth


def _write(
    path: Path, arch: str, tensors: dict[str, np.ndarray], experts: tuple[int, int] | None = None
) -> Path:
    writer = GGUFWriter(str(path), arch)
    if experts is not None:
        writer.add_expert_count(experts[0])
        writer.add_expert_used_count(experts[1])
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_tied_head_reads_the_whole_embedding(tmp_path: Path) -> None:
    embd, q = np.ones((8, 32), np.float32), np.ones((16, 32), np.float32)  # 1024 and 2048 bytes
    gguf = _write(tmp_path / "tied.gguf", "llama", {"token_embd.weight": embd, "blk.0.attn_q.weight": q})
    assert decode_bytes(gguf) == 1024 + 2048


def test_a_separate_head_leaves_one_embedding_row(tmp_path: Path) -> None:
    tensors = {
        "token_embd.weight": np.ones((8, 32), np.float32),  # one row: 128 bytes
        "blk.0.attn_q.weight": np.ones((16, 32), np.float32),
        "output.weight": np.ones((8, 32), np.float32),
    }
    assert decode_bytes(_write(tmp_path / "head.gguf", "llama", tensors)) == 128 + 2048 + 1024


def test_a_per_layer_embedding_reads_one_row(tmp_path: Path) -> None:
    tensors = {
        "token_embd.weight": np.ones((8, 32), np.float32),  # the tied head: read whole, 1024 bytes
        "per_layer_token_embd.weight": np.ones((8, 64), np.float32),  # one row: 256 bytes
        "blk.0.attn_q.weight": np.ones((16, 32), np.float32),
    }
    assert decode_bytes(_write(tmp_path / "ple.gguf", "gemma4", tensors)) == 1024 + 256 + 2048


def test_experts_count_at_the_share_a_token_uses(tmp_path: Path) -> None:
    tensors = {
        "token_embd.weight": np.ones((8, 32), np.float32),
        "output.weight": np.ones((8, 32), np.float32),
        "blk.0.ffn_gate_inp.weight": np.ones((4, 32), np.float32),  # the router: read whole, 512 bytes
        "blk.0.ffn_gate_exps.weight": np.ones((4, 16, 32), np.float32),  # 8192 bytes over 4 experts
    }
    gguf = _write(tmp_path / "moe.gguf", "qwen3moe", tensors, experts=(4, 2))
    assert decode_bytes(gguf) == 128 + 1024 + 512 + 8192 * 2 // 4


def test_read_bandwidth_is_a_pace() -> None:
    assert 0.1 < read_bandwidth(mb=16, repeats=2) < 10_000  # GB/s of any machine that runs the tests


def test_floor_x_is_a_tokens_time_over_its_bytes_at_the_pace() -> None:
    # 100 MB at 50 GB/s is 2 ms: a 10 ms token is 5x its floor, a 2 ms one is at it
    assert floor_x(10.0, 100_000_000, 50.0) == pytest.approx(5.0)
    assert floor_x(2.0, 100_000_000, 50.0) == pytest.approx(1.0)
    assert floor_x(2.0, 100_000_000, 25.0) == pytest.approx(0.5)
