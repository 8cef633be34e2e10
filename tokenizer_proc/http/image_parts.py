"""An OpenAI image part's URL -> the engine's ImagePart: a ``data:`` URI's bytes, or a local path
(read, if the operator allows a directory, by tokenizer_proc/images.py). Remote URLs are refused:
a server that fetches what a client names is a way into the operator's network."""

from __future__ import annotations

import base64
import binascii

from protocol.chat import ImagePart
from tokenizer_proc.http.errors import bad_param

_REMOTE = ("http://", "https://", "ftp://")


def image_part(url: str, param: str) -> ImagePart:
    """The part ``url`` names; a 400 naming ``param`` for a remote URL or a malformed data URI."""
    if url.startswith("data:"):
        header, comma, payload = url.partition(",")
        if not comma or not header.endswith(";base64"):
            raise bad_param(param, "a data URI must be data:<type>;base64,<data>")
        try:
            return ImagePart(data=base64.b64decode(payload, validate=True))
        except (binascii.Error, ValueError) as exc:
            raise bad_param(param, f"the data URI's base64 does not decode: {exc}") from exc
    if url.lower().startswith(_REMOTE):
        raise bad_param(param, "remote image URLs are not fetched: send the image as a data: URI")
    if url.startswith("file://") or url.startswith("/"):
        return ImagePart(path=url.removeprefix("file://"))
    raise bad_param(param, "expected a data: URI (or a local file path, where the engine allows one)")
