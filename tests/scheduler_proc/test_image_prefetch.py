"""The waiting requests' images ride along with a batch that brings a new image
(ForwardBatch.prefetch_images), so the worker's tower sees several at once."""

from __future__ import annotations

from protocol.worker_messages import PREFETCH_IMAGES
from tests.scheduler_proc.harness import Driver
from tests.scheduler_proc.test_images import image, prompt_with_image, submit
from tests.scheduler_proc.test_prefix_cache import config


def test_a_prefill_batch_carries_the_waiting_images_up_to_the_limit() -> None:
    """Prompts of 8 tokens with an image each, chunks of 8: one request a batch. Request 5's image
    is request 0's (sent once); the first batch carries the next PREFETCH_IMAGES unsent ones."""
    d = Driver(config(page_size=4, num_pages=1024, chunked_prefill_size=8, max_prefill_tokens=8))
    keys = [100 + i for i in range(PREFETCH_IMAGES + 3)]
    keys[5] = keys[0]
    for rid, key in enumerate(keys):
        submit(d, rid, prompt_with_image(2, 4, 2), [image(key, 2, 4)])
    d.run()
    prefills = [b for b in d.batches if b.images]
    first = prefills[0]
    assert [i.key for i in first.images] == [keys[0]], "one request's image in the first batch"
    want = [k for k in keys[1:] if k != keys[0]][:PREFETCH_IMAGES]
    assert [i.key for i in first.prefetch_images] == want, "the next waiting images, in order, once each"
    for b in d.batches:
        assert not {i.key for i in b.images} & {i.key for i in b.prefetch_images}, "an image sent twice"
    # Later batches bring only images sent already, until the first one past the limit.
    later = [([i.key for i in b.images], [i.key for i in b.prefetch_images]) for b in prefills[1:]]
    assert all(not prefetch for own, prefetch in later if set(own) <= {keys[0], *want})
    assert any(keys[-1] in own for own, _ in later), "the image past the limit came with its request"
    assert not any(b.prefetch_images for b in d.batches if not b.images)
    d.assert_no_leak()
