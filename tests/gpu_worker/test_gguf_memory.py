"""A GGUF too big for memory as float32 loads in its blocks: no parameter a block replaces is ever
allocated (the model is built on the meta device: gpu_worker/weights/common.py).

A child process loads a Llama of Q4_0 blocks (about 1.8 GB as float32, a seventh of that in the file)
under an address-space limit (RLIMIT_AS, as ``ulimit -v`` sets it) of its own size after its imports
plus half the model's float32 bytes. The file's blocks load, and the same file dequantized is refused
an allocation under that limit (so the limit is below what float32 parameters take). A model built
with full-size ``torch.empty`` parameters, even never written, takes their address space and fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from gpu_worker.weights.model_files import resolve_model

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS and /proc/self/status")

Q = gguf.GGMLQuantizationType
HIDDEN, FFN, LAYERS, VOCAB, HEADS, KV_HEADS = 1024, 4096, 28, 32768, 16, 4

# Runs in the child: argv = GGUF file, its metadata directory, the bytes allowed above its own size,
# the block type kept.
_CHILD = """
import gc, json, resource, sys
from pathlib import Path
import torch
from gpu_worker.weights.loader import load_model

def address_space() -> int:
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))

torch.set_num_threads(1)
path, meta, allowed, kept = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
limit = address_space() + allowed
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
model, _ = load_model(meta, torch.float32, torch.device("cpu"), path, frozenset({kept}))
held = [m.quantized is not None for m in model.modules() if hasattr(m, "quantized")]
dense = sum(p.numel() for p in model.parameters())
del model
gc.collect()
try:
    load_model(meta, torch.float32, torch.device("cpu"), path, frozenset())
    refused = ""
except (RuntimeError, MemoryError) as exc:
    refused = str(exc)[:200]
print(json.dumps({"held": held, "dense_params": dense, "dequantized_refused": refused}))
"""


def _write_llama(path: Path) -> int:
    """A Llama GGUF of zeroed Q4_0 blocks (F32 norms, a tied embedding); returns its float32 bytes."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    kv = HIDDEN // HEADS * KV_HEADS
    layer = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN),
             "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
             "ffn_down": (HIDDEN, FFN)}  # fmt: skip
    shapes = {"token_embd.weight": (VOCAB, HIDDEN)}
    shapes |= {f"blk.{i}.{name}.weight": dims for i in range(LAYERS) for name, dims in layer.items()}
    size, block_bytes = gguf.GGML_QUANT_SIZES[Q.Q4_0]
    for name, (rows, cols) in shapes.items():
        writer.add_tensor(name, np.zeros((rows, cols // size * block_bytes), np.uint8), raw_dtype=Q.Q4_0)
    norms = ["output_norm"] + [f"blk.{i}.{n}" for i in range(LAYERS) for n in ("attn_norm", "ffn_norm")]
    for name in norms:
        writer.add_tensor(f"{name}.weight", np.ones(HIDDEN, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return 4 * (sum(rows * cols for rows, cols in shapes.values()) + len(norms) * HIDDEN)


def test_blocks_load_under_an_address_space_below_the_float32_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "big.gguf"
    float32_bytes = _write_llama(path)
    assert float32_bytes > 6 * path.stat().st_size, "the float32 model must dwarf the file"
    monkeypatch.setenv("RIVULET_CACHE_DIR", str(tmp_path / "cache"))
    meta = resolve_model(str(path))
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), meta, str(float32_bytes // 2), str(int(Q.Q4_0))],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    out = json.loads(child.stdout.strip().splitlines()[-1])
    assert out["held"] and all(out["held"]), "every Linear and the embedding in blocks"
    assert out["dense_params"] == (2 * LAYERS + 1) * HIDDEN, "only the norms are dense"
    assert "allocate" in out["dequantized_refused"], "the limit must refuse float32 parameters"
