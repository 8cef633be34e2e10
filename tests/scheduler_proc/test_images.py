"""Images in the scheduler: the prefix cache keys an image's tokens by its hash, and every row that
extends over an image's tokens carries it (a chunk may cut inside them)."""

from __future__ import annotations

import msgspec

from protocol.images import ImageInput
from tests.scheduler_proc.harness import Driver, tokenized
from tests.scheduler_proc.test_prefix_cache import config, tokens

IMAGE_TOKEN = 7


def image(key: int, offset: int, length: int) -> ImageInput:
    return ImageInput(key=key, offset=offset, length=length, shape=[1], pixels=b"\0\0\0\0")


def prompt_with_image(offset: int, length: int, tail: int) -> list[int]:
    return tokens(offset, 1) + [IMAGE_TOKEN] * length + tokens(tail, 2)


def submit(d: Driver, rid: int, prompt: list[int], images: list[ImageInput]) -> None:
    assert d.sched.add(msgspec.structs.replace(tokenized(rid, prompt, 2), images=images)) is None
    d.tokens[rid] = []


def test_the_same_image_is_a_hit_and_another_image_is_not() -> None:
    d = Driver(config(page_size=1, num_pages=4096))
    prompt = prompt_with_image(10, 16, 6)
    submit(d, 0, prompt, [image(111, 10, 16)])
    d.run()
    submit(d, 1, prompt, [image(222, 10, 16)])  # the same token ids, another picture
    d.run()
    submit(d, 2, prompt, [image(111, 10, 16)])
    d.run()
    assert d.cached == {0: 0, 1: 10, 2: len(prompt) - 1}, "up to the image; all for the same image"
    d.assert_no_leak()


def test_every_chunk_over_an_image_carries_it() -> None:
    """An image longer than the chunk budget (16 tokens, chunks of 8) is cut; each chunk carries it."""
    d = Driver(config(page_size=4, num_pages=1024, chunked_prefill_size=8))
    prompt = prompt_with_image(5, 16, 6)
    submit(d, 0, prompt, [image(5, 5, 16)])
    d.run()
    covered: set[int] = set()
    for batch in d.batches:
        for row, img in zip(batch.image_rows, batch.images, strict=True):
            first = batch.prefix_lens[row]
            span = range(max(first, img.offset), min(first + batch.extend_lens[row], img.end))
            assert span, "a row carries only images with tokens among its positions"
            covered.update(span)
    assert covered == set(range(5, 21)), "each image token's row carried the image"
    assert [b.extend_lens[0] for b in d.batches[:4]] == [5, 8, 8, 6], "the first chunk ends at the image"


def test_a_chunk_ends_before_an_image_it_would_cut() -> None:
    d = Driver(config(page_size=4, num_pages=1024, chunked_prefill_size=8))
    prompt = prompt_with_image(6, 4, 10)  # the image at [6, 10): a chunk of 8 would cut it
    submit(d, 0, prompt, [image(9, 6, 4)])
    d.run()
    assert [b.extend_lens[0] for b in d.batches[:3]] == [6, 8, 6]
    assert [len(b.images) for b in d.batches[:3]] == [0, 1, 0], "the image whole in one chunk"
