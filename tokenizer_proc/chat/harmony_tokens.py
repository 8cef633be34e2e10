"""Harmony's markers (gpt-oss's format of messages, channels and recipients) and their ids in a
model's vocabulary: a model whose tokenizer has every one of them as a single token is served as
harmony (its prompts rendered and its replies parsed as chat/harmony*.py do)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
FUNCTIONS = "functions."  # the namespace of the client's tools in a recipient (to=functions.NAME)


@dataclass(frozen=True)
class HarmonyTokens:
    """The ids of harmony's markers in a vocabulary (``by_id``: id -> marker text)."""

    by_id: dict[int, str]

    def id_of(self, marker: str) -> int:
        return next(i for i, m in self.by_id.items() if m == marker)

    @property
    def ends(self) -> tuple[int, int]:
        """The ids that end a reply: the last answer, a tool call."""
        return self.id_of(RETURN), self.id_of(CALL)


def harmony_tokens(tokenizer: PreTrainedTokenizerBase) -> HarmonyTokens | None:
    """Harmony's markers in ``tokenizer``'s vocabulary, each one token; None unless all are."""
    vocab = tokenizer.get_vocab()
    ids = {marker: vocab.get(marker) for marker in MARKERS}
    if any(i is None for i in ids.values()):
        return None
    return HarmonyTokens({i: marker for marker, i in ids.items() if i is not None})
