"""The tokenizer of a GGUF model, built from the file's metadata once and saved beside its config.

``resolve_model`` (gpu_worker/weights/model_files.py) gives a GGUF a directory holding config.json,
generation_config.json and ``gguf.json`` (the file's path), no tokenizer: building one means reading
the vocabulary (128k strings for Llama 3) and the merges, which takes seconds, and the tokenizer
process does it here, while the worker loads the weights. transformers builds it from the metadata
(``gguf_file=``) with the class its ``AutoTokenizer`` picks for the model type, as it would for the
file itself; called through ``AutoTokenizer`` that path would also parse every metadata field with
gguf's slow reader to make a config (far slower still for a Llama 3 vocabulary: docs/benchmarks-history.md),
so the class is called directly. The saved files (tokenizer.json about 10 MB for 128k tokens) make
every later start an ordinary HF directory load.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

GGUF_MARKER = "gguf.json"  # model_files.py's: {"gguf": the file's path}
_DONE = "tokenizer.json"  # moved in last: its presence means the tokenizer is complete


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF whose metadata directory ``model_dir`` is, else None (an HF directory)."""
    marker = model_dir / GGUF_MARKER
    return Path(json.loads(marker.read_text())["gguf"]) if marker.is_file() else None


def ensure_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase | None:
    """Build and save the tokenizer of ``model_dir``'s GGUF and return it (the first start saves
    reading it back), unless it is there already or the directory is an HF one (None)."""
    gguf = gguf_source(model_dir)
    if gguf is None or (model_dir / _DONE).is_file():
        return None
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    name = TOKENIZER_MAPPING_NAMES.get(model_type) or "TokenizersBackend"
    cls = tokenizer_class_from_name(name)
    assert cls is not None, f"transformers has no tokenizer class {name}"
    tokenizer = cls.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    staging = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=model_dir))
    try:
        tokenizer.save_pretrained(str(staging))
        # Read back as the pipeline tokenizer.json holds, not rebuilt by the model type's class (whose
        # constructor may set its own pre-tokenizer: the saved files must give the built tokenizer).
        config_file = staging / "tokenizer_config.json"
        config_file.write_text(
            json.dumps({**json.loads(config_file.read_text()), "tokenizer_class": "TokenizersBackend"})
        )
        files = sorted(staging.iterdir(), key=lambda f: f.name == _DONE)
        for file in files:  # each move atomic; a concurrent start writes the same bytes
            os.replace(file, model_dir / file.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("tokenizer of %s built from its metadata (%s) into %s", gguf.name, name, model_dir)
    return tokenizer
