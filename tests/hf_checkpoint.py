"""A GGUF as a full HF checkpoint (safetensors, float32, dequantized by transformers' own GGUF loader):
the reference the exactness tests compare the engine with, and the weights of tests that want an HF
directory of a real model. The engine itself never converts a GGUF (gpu_worker/weights/model_files.py).

Written once per machine into the rivulet cache (``test-checkpoints/``), keyed like the engine's own
GGUF directories by the file's path, size and mtime.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path


def hf_checkpoint(gguf: Path) -> Path:
    """The HF directory of ``gguf``'s model: config and tokenizer as the engine reads them from the
    metadata, weights dequantized by transformers."""
    from gpu_worker.weights.model_files import cache_root, file_key, resolve_model
    from tokenizer_proc.gguf_tokenizer import ensure_tokenizer

    target = cache_root() / "test-checkpoints" / f"{gguf.stem}-{file_key(gguf)}"
    if (target / "model.safetensors").is_file():
        return target
    meta = resolve_model(str(gguf))
    ensure_tokenizer(meta)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        for file in meta.iterdir():
            if file.is_file() and file.name != "gguf.json":
                shutil.copy(file, staging / file.name)
        _write_weights(gguf, staging)
        try:
            staging.rename(target)
        except OSError:  # a concurrent session converted it first
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_weights(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    tied = bool(config.get("tie_word_embeddings", False))
    weights = {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
