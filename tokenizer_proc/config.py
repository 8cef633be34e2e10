"""The tokenizer process's configuration, built once by the launcher."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenizerConfig:
    """``model_path`` is the resolved HF directory holding the tokenizer files."""

    model_path: str = ""
    seed: int = 0  # draws per-request sampling seeds when the client gives none
