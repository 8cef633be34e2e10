"""What a model's files say about embeddings: the pooling, the vector's size and which smaller
sizes (Matryoshka) it may be cut to; and the normalization every embedding gets.

Pooling comes from a sentence-transformers Pooling module when the model directory has one
(``modules.json`` -> its ``config.json``: ``pooling_mode_lasttoken`` or ``pooling_mode_mean_tokens``);
without one a decoder LM pools its last token. Other modes (CLS, max, ...) are not done: such a
model's embedding requests are refused, naming the mode, rather than answered with other values.
``--pooling last`` or ``mean`` sets the pooling whatever the files say (``auto``: as they say).
``dimensions`` may cut a vector only for a model whose config.json says it was trained for it
(``matryoshka_dimensions``: the sizes; ``is_matryoshka``: any size), as vLLM reads it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.embedding import Pooling

_ST_POOLING = "sentence_transformers.models.Pooling"
_MODES = {"pooling_mode_lasttoken": Pooling.LAST, "pooling_mode_mean_tokens": Pooling.MEAN}


@dataclass(frozen=True)
class EmbeddingSpec:
    """How the model's embeddings are made; ``pooling`` None: refused, ``unsupported`` says why."""

    pooling: Pooling | None = Pooling.LAST
    unsupported: str = ""
    hidden_size: int = 0  # 0: unknown (then only an absent ``dimensions`` is accepted)
    matryoshka: tuple[int, ...] = ()  # the sizes a vector may be cut to
    any_size: bool = False  # is_matryoshka: any size up to hidden_size

    def dimensions_error(self, dimensions: int) -> str | None:
        """Why a vector cannot be given at ``dimensions`` values, or None."""
        if dimensions == self.hidden_size:
            return None
        if dimensions in self.matryoshka or (self.any_size and 1 <= dimensions <= self.hidden_size):
            return None
        if not (self.matryoshka or self.any_size):
            return f"this model's embeddings have {self.hidden_size} values and cannot be shortened"
        sizes = f"1..{self.hidden_size}" if self.any_size else str(list(self.matryoshka))
        return f"must be one of this model's sizes {sizes}, got {dimensions}"


def read_embedding_spec(model_dir: Path, config: dict[str, Any], pooling: str = "auto") -> EmbeddingSpec:
    """The spec from ``model_dir``'s files; ``config``: its config.json (the LM's part);
    ``pooling``: ``auto`` (the files' pooling) or a ``Pooling`` value that overrides them."""
    hidden = int(config.get("hidden_size") or config.get("n_embd") or 0)
    sizes = tuple(int(d) for d in config.get("matryoshka_dimensions") or ())
    chosen, unsupported = _pooling(model_dir) if pooling == "auto" else (Pooling(pooling), "")
    return EmbeddingSpec(chosen, unsupported, hidden, sizes, bool(config.get("is_matryoshka")))


def _pooling(model_dir: Path) -> tuple[Pooling | None, str]:
    modules = _read_json(model_dir / "modules.json")
    entry = next((m for m in modules if isinstance(m, dict) and m.get("type") == _ST_POOLING), None)
    if entry is None:
        return Pooling.LAST, ""
    settings = _read_json(model_dir / str(entry.get("path", "")) / "config.json")
    modes = sorted(k for k, v in settings.items() if k.startswith("pooling_mode_") and v is True)
    if len(modes) == 1 and modes[0] in _MODES:
        return _MODES[modes[0]], ""
    return None, f"the model's pooling {modes} is not supported (last token or mean only)"


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else {}


def normalized(values: list[float]) -> list[float]:
    """``values`` scaled to unit L2 norm (a zero vector stays zero)."""
    norm = math.sqrt(math.fsum(v * v for v in values))
    return [v / norm for v in values] if norm > 0 else list(values)
