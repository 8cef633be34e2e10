"""Each token's own bytes: joined they rebuild the text, even where a token is part of a character."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenizer_proc.token_bytes import TokenTexts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TEXT = "héllo wörld 😀 日本語 naïve"


def test_byte_level_bpe_tokens_join_into_the_text(tokenizer: PreTrainedTokenizerBase) -> None:
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode(TEXT)
    assert b"".join(texts.bytes_of(t) for t in ids) == TEXT.encode()
    partial = [texts.text_of(t) for t in ids if texts.text_of(t).startswith("bytes:")]
    assert partial, "SmolLM2 splits the emoji or the CJK characters across tokens"
    assert all(p.startswith("bytes:\\x") for p in partial)
    whole = [t for t in ids if not texts.text_of(t).startswith("bytes:")]
    assert all(texts.text_of(t).encode() == texts.bytes_of(t) for t in whole)
    eos = tokenizer.get_vocab()["<|im_end|>"]
    assert texts.text_of(eos) == "<|im_end|>"


class _SentencePiece:
    """The parts of a sentencepiece tokenizer with byte fallback that TokenTexts reads."""

    pieces = {0: "<s>", 1: "\u2581hello", 2: "<0xE2>", 3: "<0x82>", 4: "<0xAC>", 5: "world"}
    all_special_ids = [0]
    all_special_tokens = ["<s>"]

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.pieces[token_id]

    def get_vocab(self) -> dict[str, int]:
        return {p: i for i, p in self.pieces.items()}

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids).replace("\u2581", "")  # drops the leading space


def test_sentencepiece_spaces_and_byte_fallback() -> None:
    fake: Any = _SentencePiece()
    texts = TokenTexts(fake)
    assert texts.bytes_of(1) == b" hello" and texts.text_of(1) == " hello"
    assert b"".join(texts.bytes_of(t) for t in (2, 3, 4)) == "€".encode()
    assert texts.text_of(2) == "bytes:\\xe2"
    assert texts.bytes_of(5) == b"world" and texts.text_of(0) == "<s>"
