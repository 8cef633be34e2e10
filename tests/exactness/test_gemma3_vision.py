"""A tiny random Gemma 3 vision-language model served end to end (images in chat messages over ZMQ
and HTTP), token for token against HF transformers in float64 given the same images.

One engine for the module, with chunks of 8 tokens and pages of 4 (a chunk ends before an image it
would cut; a cache hit may end inside one). HF is given the processor's token_type_ids: an image's
tokens attend to each other both ways, as ours do; on two of the three prompts the causal mask gives
other tokens.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from client import Client
from tests.tokenizer_proc.http.server import HttpEngine, http_engine
from tests.vision_models import encoded, hf_greedy, random_image, save_tiny_gemma3_vlm, solid_image

NEW_TOKENS = 6
Parts = list[tuple[str, bytes | str]]  # ("text", str) and ("image", the file's bytes)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> tuple[Path, Any, Any]:
    out = tmp_path_factory.mktemp("gemma3-vlm")
    model, processor = save_tiny_gemma3_vlm(out, smollm2_dir)
    return out, model, processor


@pytest.fixture(scope="module")
def engine(vlm: tuple[Path, Any, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpEngine]:
    args = (
        "--dtype",
        "float64",
        "--chunked-prefill-size",
        "8",
        "--page-size",
        "4",
        "--served-model-name",
        "rivulet",
    )
    with http_engine(vlm[0], tmp_path_factory.mktemp("vlm-engine"), *args) as e:
        yield e


def user_turn(parts: Parts) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the ZMQ client's message, the template's) for ("text", str) and ("image", bytes) parts."""
    ours = [{"type": "text", "text": v} if k == "text" else {"type": "image", "data": v} for k, v in parts]
    template = [{"type": "text", "text": v} if k == "text" else {"type": "image"} for k, v in parts]
    return [{"role": "user", "parts": ours}], [{"role": "user", "content": template}]


def expected(vlm: tuple[Path, Any, Any], parts: Parts) -> list[int]:
    _, model, processor = vlm
    _, template = user_turn(parts)
    text = processor.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    files = [v for k, v in parts if k == "image" and isinstance(v, bytes)]
    return hf_greedy(model, processor, text, files, NEW_TOKENS)[1]


def served(engine: HttpEngine, parts: Parts) -> tuple[list[int], int]:
    """(output ids, cached prompt tokens) of the engine's greedy reply over ZMQ."""
    messages, _ = user_turn(parts)
    with Client(engine.engine.endpoint, timeout_s=120) as client:
        out = client.generate(messages=messages, max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    assert out.error is None, out.error
    assert out.usage is not None
    return out.token_ids, out.usage.cached_tokens


RANDOM_PNG = encoded(random_image(0, 50, 70), "PNG")
RED_JPEG = encoded(solid_image((220, 20, 20), 64, 64), "JPEG")
BLUE_GIF = encoded(solid_image((10, 30, 200), 40, 90), "GIF")
GREEN_WEBP = encoded(solid_image((20, 200, 40), 80, 30), "WEBP")
NOISE_WEBP = encoded(random_image(3, 64, 64), "WEBP")


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "parts",
    [
        [("text", "Describe "), ("image", RANDOM_PNG), ("text", " please.")],
        [("image", RED_JPEG), ("text", "and"), ("image", BLUE_GIF), ("text", "which is brighter?")],
        [("text", "A"), ("image", GREEN_WEBP), ("image", NOISE_WEBP)],
    ],
    ids=["random-png", "jpeg-and-gif", "two-webp-adjacent"],
)
def test_images_match_hf(vlm: tuple[Path, Any, Any], engine: HttpEngine, parts: Parts) -> None:
    want = expected(vlm, parts)
    got, _ = served(engine, parts)
    assert got == want


@pytest.mark.timeout(600)
def test_another_image_is_no_cache_hit_and_the_same_one_is(
    vlm: tuple[Path, Any, Any], engine: HttpEngine
) -> None:
    question = "What is in this picture, in a few words?"
    first: Parts = [("text", question), ("image", encoded(random_image(11, 64, 64), "PNG"))]
    other: Parts = [("text", question), ("image", encoded(solid_image((0, 0, 0), 64, 64), "PNG"))]
    want_first, want_other = expected(vlm, first), expected(vlm, other)
    assert want_first != want_other, "the test needs images the model tells apart"
    got_first, _ = served(engine, first)
    got_other, cached_other = served(engine, other)
    got_again, cached_again = served(engine, first)
    assert (got_first, got_other, got_again) == (want_first, want_other, want_first)
    prompt_len = len(hf_prompt(vlm, first))
    image_start = hf_prompt(vlm, first).index(vlm[2].tokenizer.image_token_id)
    assert cached_other <= image_start, "KV is shared only up to the image that differs"
    assert cached_again >= prompt_len - 4, "the same image: the whole prompt's full pages are a hit"


def hf_prompt(vlm: tuple[Path, Any, Any], parts: Parts) -> list[int]:
    _, model, processor = vlm
    _, template = user_turn(parts)
    text = processor.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    return hf_greedy(model, processor, text, [v for k, v in parts if isinstance(v, bytes)], 1)[0]


def data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.mark.timeout(600)
def test_http_chat_and_responses_take_images(vlm: tuple[Path, Any, Any], engine: HttpEngine) -> None:
    parts: Parts = [("text", "Describe "), ("image", RANDOM_PNG), ("text", " please.")]
    want = vlm[2].tokenizer.decode(expected(vlm, parts))
    content = [{"type": "text", "text": "Describe "},
               {"type": "image_url", "image_url": {"url": data_uri(RANDOM_PNG, "image/png")}},
               {"type": "text", "text": " please."}]  # fmt: skip
    body = {"model": "rivulet", "messages": [{"role": "user", "content": content}],
            "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}  # fmt: skip
    r = httpx.post(engine.v1 + "/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want
    items = [{"type": "input_text", "text": "Describe "},
             {"type": "input_image", "image_url": data_uri(RANDOM_PNG, "image/png")},
             {"type": "input_text", "text": " please."}]  # fmt: skip
    body = {"model": "rivulet", "input": [{"role": "user", "content": items}],
            "max_output_tokens": NEW_TOKENS, "temperature": 0, "store": False}  # fmt: skip
    r = httpx.post(engine.v1 + "/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["output"][-1]["content"][0]["text"] == want


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("url", "status", "param"),
    [
        ("https://example.com/cat.png", 400, "messages[0].content[1].image_url.url"),
        ("data:image/png;base64,@@@", 400, "messages[0].content[1].image_url.url"),
        (data_uri(b"not an image at all", "image/png"), 400, "messages[0].content[1]"),
        ("/etc/passwd", 400, "messages[0].content[1]"),
    ],
    ids=["remote-url", "bad-base64", "undecodable", "local-path-not-allowed"],
)
def test_bad_image_parts_are_a_400_naming_the_part(
    engine: HttpEngine, url: str, status: int, param: str
) -> None:
    content = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"model": "rivulet", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    r = httpx.post(engine.v1 + "/chat/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.timeout(300)
def test_too_many_images_and_a_too_large_image(engine: HttpEngine) -> None:
    png = {"type": "image_url", "image_url": {"url": data_uri(RED_JPEG, "image/jpeg")}}
    body = {"model": "rivulet", "messages": [{"role": "user", "content": [png] * 9}], "max_tokens": 2}
    r = httpx.post(engine.v1 + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "over the limit of 8" in r.text, r.text
    huge = encoded(solid_image((1, 2, 3), 7000, 7000), "PNG")  # 49 MP: past the pixel limit, a small file
    part = {"type": "image_url", "image_url": {"url": data_uri(huge, "image/png")}}
    body = {"model": "rivulet", "messages": [{"role": "user", "content": [part]}], "max_tokens": 2}
    r = httpx.post(engine.v1 + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 413, r.text
