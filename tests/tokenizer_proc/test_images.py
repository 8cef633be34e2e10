"""Image parts in the tokenizer: reading (inline, or local files only under the allowed directory),
decoding (formats, a GIF's first frame, limits), the HTTP part's URL, and a text model's refusal."""

from __future__ import annotations

import io
import random
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from transformers import PreTrainedTokenizerBase

from protocol.chat import ChatMessage, ContentPart, ImagePart, TextPart
from protocol.messages import GenerateRequest
from tokenizer_proc.http.errors import ApiError
from tokenizer_proc.http.image_parts import image_part
from tokenizer_proc.images import IMAGE_TOO_LARGE, ImageLimits, decode_image, read_part, token_runs
from tokenizer_proc.model_info import ModelInfo
from tokenizer_proc.validation import RequestRejected, validate_generate

PARAM = "messages[0].content[1]"


def image_file(fmt: str, rgb: tuple[int, int, int] = (10, 20, 30), size: tuple[int, int] = (8, 6)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, rgb).save(out, format=fmt)
    return out.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_each_format_decodes_to_rgb(fmt: str) -> None:
    image = decode_image(image_file(fmt, size=(9, 5)), PARAM, ImageLimits())
    assert image.mode == "RGB" and image.size == (9, 5)


def test_a_gif_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (4, 4), rgb) for rgb in ((255, 0, 0), (0, 0, 255))]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
    pixels = np.asarray(decode_image(out.getvalue(), PARAM, ImageLimits()))
    assert tuple(pixels[0, 0]) == (255, 0, 0)


def test_other_formats_garbage_and_huge_images_are_refused_naming_the_part() -> None:
    with pytest.raises(RequestRejected, match="BMP") as bmp:
        decode_image(image_file("BMP"), PARAM, ImageLimits())
    with pytest.raises(RequestRejected, match="could not be decoded") as garbage:
        decode_image(b"\x89PNG\r\n\x1a\n not really", PARAM, ImageLimits())
    with pytest.raises(RequestRejected) as huge:
        decode_image(image_file("PNG", size=(100, 100)), PARAM, ImageLimits(max_pixels=9999))
    assert bmp.value.param == garbage.value.param == huge.value.param == PARAM
    assert huge.value.code == IMAGE_TOO_LARGE
    with pytest.raises(RequestRejected) as big:
        read_part(ImagePart(data=b"x" * 11), PARAM, ImageLimits(max_bytes=10))
    assert big.value.code == IMAGE_TOO_LARGE


def test_local_files_only_under_the_allowed_directory(tmp_path: Path) -> None:
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(image_file("PNG"))
    (tmp_path / "secret.png").write_bytes(image_file("PNG"))
    limits = ImageLimits(local_dir=str(allowed))
    assert read_part(ImagePart(path=f"file://{allowed}/cat.png"), PARAM, limits) == image_file("PNG")
    for path in (str(tmp_path / "secret.png"), f"{allowed}/../secret.png", "/etc/passwd"):
        with pytest.raises(RequestRejected, match="no file under the allowed directory"):
            read_part(ImagePart(path=path), PARAM, limits)
    with pytest.raises(RequestRejected, match="without --allowed-local-media-path"):
        read_part(ImagePart(path=f"{allowed}/cat.png"), PARAM, ImageLimits())
    with pytest.raises(RequestRejected, match="exactly one"):
        read_part(ImagePart(), PARAM, limits)


def test_http_urls() -> None:
    assert image_part("data:image/png;base64,aGVsbG8=", "u").data == b"hello"
    assert image_part("file:///srv/a.png", "u").path == "/srv/a.png"
    for url in (
        "https://example.com/a.png",
        "http://10.0.0.1/x",
        "data:image/png,raw",
        "data:;base64,!!",
        "a.png",
    ):
        with pytest.raises(ApiError) as err:
            image_part(url, "messages[0].content[2].image_url.url")
        assert err.value.status == 400 and err.value.param == "messages[0].content[2].image_url.url"


def test_token_runs() -> None:
    assert token_runs([5, 9, 9, 1, 9, 2, 9, 9, 9], 9) == [(1, 2), (4, 1), (6, 3)]
    assert token_runs([1, 2], 9) == []


def test_a_text_model_refuses_images(tokenizer: PreTrainedTokenizerBase) -> None:
    info = ModelInfo(context_len=512, vocab_size=len(tokenizer), eos_token_ids=(2,))
    parts: list[ContentPart] = [TextPart(text="what is this?"), ImagePart(data=image_file("PNG"))]
    req = GenerateRequest(rid="r", messages=[ChatMessage(role="user", parts=parts)])
    with pytest.raises(RequestRejected, match="no vision tower") as err:
        validate_generate(req, tokenizer, info, random.Random(0))
    assert err.value.param == PARAM
    text_only = GenerateRequest(rid="r", messages=[ChatMessage(role="user", parts=parts[:1])])
    assert validate_generate(text_only, tokenizer, info, random.Random(0)).images == []
