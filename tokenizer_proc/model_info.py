"""What the tokenizer process needs to know about the model: its tokenizer and its limits."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizer_proc.chat.harmony_tokens import harmony_tokens
from tokenizer_proc.gguf_tokenizer import ensure_tokenizer
from tokenizer_proc.images import VisionProcessor
from tokenizer_proc.pooling import EmbeddingSpec, read_embedding_spec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# config.json keys that name the context length, in order of preference (GPT-2 says n_positions).
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx")


@dataclass(frozen=True)
class ModelInfo:
    """The model limits a request is validated against."""

    context_len: int  # prompt + output tokens must stay below this
    vocab_size: int  # token ids live in [0, vocab_size)
    eos_token_ids: tuple[int, ...]  # any of these ends a request (unless ignore_eos)
    embedding: EmbeddingSpec = EmbeddingSpec()  # how embed requests pool, and the vector's sizes
    images: VisionProcessor | None = None  # a vision-language model's processor; None: text only

    def __post_init__(self) -> None:
        assert self.context_len > 1, f"context_len {self.context_len} leaves no room for output"
        assert self.vocab_size > 0, f"vocab_size {self.vocab_size} must be positive"


def load_tokenizer(model_path: str) -> PreTrainedTokenizerBase:
    """The HF fast tokenizer of ``model_path`` (imported lazily: transformers is slow to import)."""
    from transformers import AutoTokenizer

    built = ensure_tokenizer(Path(model_path))  # a GGUF's: built from its metadata on the first start
    return built if built is not None else AutoTokenizer.from_pretrained(model_path)


def read_model_info(model_path: str, tokenizer: PreTrainedTokenizerBase, pooling: str = "auto") -> ModelInfo:
    """Context length and vocab from config.json; EOS ids from every place that may name them;
    the embeddings' spec, pooled as ``pooling`` (--pooling) says.

    EOS ids are the union of generation_config.json, config.json and the tokenizer's
    eos token: instruct models often end turns with a token that only one of them lists.
    """
    config = _read_json(Path(model_path) / "config.json")
    config = config.get("text_config", config)  # multimodal configs nest the LM's
    generation = _read_json(Path(model_path) / "generation_config.json")
    context_len = next((int(config[k]) for k in _CONTEXT_KEYS if config.get(k)), None)
    if context_len is None:
        raise ValueError(f"{model_path}/config.json names no context length (tried {_CONTEXT_KEYS})")
    vocab_size = int(config.get("vocab_size") or len(tokenizer))
    eos: list[int] = []
    harmony = harmony_tokens(tokenizer)  # a harmony reply ends at <|return|> or <|call|>, listed or not
    ends = list(harmony.ends) if harmony is not None else []
    for source in (generation.get("eos_token_id"), config.get("eos_token_id"), tokenizer.eos_token_id, ends):
        for token_id in _as_id_list(source):
            if token_id not in eos:
                eos.append(token_id)
    embedding = read_embedding_spec(Path(model_path), config, pooling)
    return ModelInfo(
        context_len=context_len, vocab_size=vocab_size, eos_token_ids=tuple(eos), embedding=embedding
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    assert isinstance(data, dict), f"{path} is not a JSON object"
    return data


def _as_id_list(value: object) -> list[int]:
    """``eos_token_id`` may be missing, an int, or a list of ints."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    assert isinstance(value, list) and all(isinstance(v, int) for v in value), f"bad eos_token_id {value!r}"
    return list(value)
