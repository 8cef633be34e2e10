"""Incremental detokenization: token ids in, text deltas out, one request at a time."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Protocol

# Byte-level BPE decodes an incomplete UTF-8 sequence to this replacement character.
REPLACEMENT_CHAR = "\ufffd"


class TokenDecoder(Protocol):
    """The one tokenizer method the detokenizer needs (an HF tokenizer has it)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str | list[str]: ...


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas.

    The concatenation of every delta (``add`` calls plus the final ``flush``)
    equals ``tokenizer.decode(token_ids, skip_special_tokens=True)``.

    Technique: decode a small window of tokens twice, once up to what was
    already emitted and once up to the newest token, and emit the difference.
    The window starts a few tokens back (``_prefix_offset``) because tokenizers
    decode a token differently at the start of a text (SentencePiece drops the
    leading space). While the newest text ends in U+FFFD the last tokens are
    part of a multi-byte character still being generated: hold them back.
    """

    def __init__(self, tokenizer: TokenDecoder) -> None:
        self._tokenizer = tokenizer
        self._direct = direct_decode(tokenizer)
        self.token_ids: list[int] = []
        # Invariant: 0 <= _prefix_offset <= _read_offset <= len(token_ids); the text of
        # token_ids[:_read_offset] has been emitted, and decoding starts at _prefix_offset.
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text that is now complete (may be empty)."""
        self.token_ids.extend(token_ids)
        return self._delta(final=False)

    def flush(self) -> str:
        """Return all text not yet emitted, even a trailing broken character."""
        return self._delta(final=True)

    def full_text(self) -> str:
        """The whole output decoded at once (what the deltas add up to)."""
        return self._decode(self.token_ids)

    def _delta(self, *, final: bool) -> str:
        if self._read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.token_ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            return ""  # only tokens without text so far (special tokens)
        if not final and new_text.endswith(REPLACEMENT_CHAR):
            return ""  # a multi-byte character is still incomplete
        # Byte-level BPE and SentencePiece decode prefix-stably here, so new_text starts
        # with prefix_text; a tokenizer that rewrites earlier text (cleanup of spaces
        # before punctuation) would only lose that rewrite, never crash the process.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        if self._direct is not None:
            return self._direct(token_ids)
        text = self._tokenizer.decode(token_ids, skip_special_tokens=True)
        assert isinstance(text, str), "decoding one sequence gives one string"
        return text


def direct_decode(tokenizer: object) -> Callable[[list[int]], str] | None:
    """``tokenizer.decode(ids, skip_special_tokens=True)`` straight from its Rust ``tokenizers``
    object, where transformers would only forward to it: a transformers fast tokenizer whose
    ``decode`` and ``_decode`` are the library's own and which cleans up no spaces. The same text;
    transformers' argument handling around it cost more than the decode of a few tokens itself
    (docs/benchmarks-history.md, "The engine's own CPU at 32 streams"). None for anything else."""
    module = sys.modules.get("transformers.tokenization_utils_tokenizers")  # loaded if it is one
    backend = getattr(module, "TokenizersBackend", None)
    base = sys.modules.get("transformers.tokenization_utils_base")
    if backend is None or base is None or not isinstance(tokenizer, backend):
        return None
    cls = type(tokenizer)
    forwards = cls._decode is backend._decode and cls.decode is base.PreTrainedTokenizerBase.decode
    if not forwards or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    rust = tokenizer._tokenizer

    def decode(token_ids: list[int]) -> str:
        return str(rust.decode(token_ids, skip_special_tokens=True))

    return decode
