"""Each token's own bytes and the string OpenAI's logprobs show for it.

A token can be part of a character (byte-level BPE splits UTF-8 sequences), so decoding it
alone gives U+FFFD. Its bytes come from the vocabulary piece instead: byte-level BPE pieces
map back through GPT-2's byte table, sentencepiece byte-fallback pieces are ``<0xNN>`` and
``▁`` is a space. A token whose bytes are not UTF-8 on their own is shown as OpenAI's legacy
API shows it, ``bytes:\\xe2\\x80``; clients join the ``bytes`` lists to rebuild text.
"""

from __future__ import annotations

import re
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPIECE_SPACE = "\u2581"


@cache
def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, reversed."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(kept)
    n = 0
    for b in range(256):
        if b not in kept:
            kept.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(kept, chars, strict=True)}


class TokenTexts:
    """Bytes and display strings of token ids, computed once per id."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._bytes: dict[int, bytes] = {}
        self._byte_level: bool | None = None

    def bytes_of(self, token_id: int) -> bytes:
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = self._compute(token_id)
        return raw

    def text_of(self, token_id: int) -> str:
        raw = self.bytes_of(token_id)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _compute(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return b""
        if token_id in self._tokenizer.all_special_ids:
            return piece.encode()
        if self._is_byte_level():
            table = _gpt2_byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        byte = _BYTE_PIECE.fullmatch(piece)
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        if _SPIECE_SPACE in piece:
            return piece.replace(_SPIECE_SPACE, " ").encode()
        return str(self._tokenizer.decode([token_id])).encode()

    def _is_byte_level(self) -> bool:
        """Every piece of the vocabulary is spelt in GPT-2's byte table (sentencepiece's ``▁`` is not)."""
        if self._byte_level is None:
            table = _gpt2_byte_decoder()
            special = set(self._tokenizer.all_special_tokens)
            pieces = [p for p in self._tokenizer.get_vocab() if p not in special]
            self._byte_level = bool(pieces) and all(c in table for p in pieces for c in p)
        return self._byte_level
