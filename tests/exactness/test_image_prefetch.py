"""Requests with different images submitted together: the first prefill batch carries the waiting
requests' images (ForwardBatch.prefetch_images), the vision tower encodes them in one call, and
every output still equals HF float64 ``generate`` (the tiny Qwen3.5 VLM of test_qwen35_images)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.exactness import inprocess
from tests.exactness.test_hybrid import runner_for
from tests.exactness.test_qwen35_images import NEW_TOKENS, _hf_greedy, _prompt, vlm

__all__ = ["vlm"]  # the module's fixture, shared


def test_waiting_images_encode_in_one_tower_call(vlm: tuple[Path, Any]) -> None:
    path, hf = vlm
    # The same size each (one pixel shape), other pixels; chunks of 7 hold one request at a time.
    prompts = [_prompt([(3, (64, 96))], seed) for seed in (10, 11, 12, 13)]
    expected = [_hf_greedy(hf, ids, px, grids)[0] for ids, _, px, grids in prompts]
    assert len({tuple(out) for out in expected}) > 1, "the images must give different outputs"
    runner = runner_for(path, state_checkpoints=-1)
    assert runner.images is not None
    batches: list[Any] = []
    ids = [ids for ids, *_ in prompts]
    got, scheduler = inprocess.generate(runner, ids, NEW_TOKENS, chunked_prefill_size=7,
                                        enable_mixed_chunk=True, batches=batches,
                                        images=[images for _, images, *_ in prompts])  # fmt: skip
    assert got == expected
    first = next(b for b in batches if b.images)
    assert len(first.images) == 1 and len(first.prefetch_images) == len(prompts) - 1
    assert runner.images.encoded_batches == [len(prompts)], "one tower call for every image"
    assert scheduler.kv.used_tokens == 0
    # Again on the same worker: every image, its own or prefetched, is cached and none encoded.
    again, _ = inprocess.generate(runner, ids, NEW_TOKENS, chunked_prefill_size=7, enable_mixed_chunk=True,
                                  images=[images for _, images, *_ in prompts])  # fmt: skip
    assert again == expected
    assert runner.images.encoded_batches == [len(prompts)]
