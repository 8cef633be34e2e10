"""HF transformers ``generate`` on the same prompts, as the offline benchmark's baseline.

Static batches (what ``generate`` does): prompts are cut into batches of one size,
left-padded within a batch, and every request produces exactly ``max_new_tokens``
tokens (``min_new_tokens`` keeps EOS from ending it early, as ignore_eos does on rivulet).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")


class HFGenerate:
    """A model loaded once; ``run`` times greedy generation over a list of token-id prompts."""

    def __init__(self, model_dir: Path, dtype: str, num_threads: int = 0, gguf: Path | None = None) -> None:
        """``gguf``: load the weights from that file (transformers dequantizes it), since the engine
        keeps a GGUF's metadata in ``model_dir`` but no copy of its weights."""
        import torch
        from transformers import AutoModelForCausalLM

        assert dtype in DTYPES, f"dtype must be one of {DTYPES}, got {dtype!r}"
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        self.torch = torch
        where = {"gguf_file": gguf.name} if gguf is not None else {}
        source = gguf.parent if gguf is not None else model_dir
        self.model: Any = AutoModelForCausalLM.from_pretrained(
            source, dtype=getattr(torch, dtype), **where
        ).eval()
        config = self.model.generation_config
        eos = config.eos_token_id
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else eos
        if isinstance(self.pad_id, list):
            self.pad_id = self.pad_id[0]
        self.pad_id = self.pad_id if self.pad_id is not None else 0

    def _batch(self, prompts: list[list[int]]) -> tuple[Any, Any]:
        width = max(len(p) for p in prompts)
        ids = [[self.pad_id] * (width - len(p)) + p for p in prompts]
        mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
        return self.torch.tensor(ids), self.torch.tensor(mask)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> int:
        """One static batch; returns the number of new tokens produced."""
        ids, mask = self._batch(prompts)
        with self.torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self.pad_id,
            )  # fmt: skip
        return int((out.shape[1] - ids.shape[1]) * out.shape[0])

    def run(self, prompts: list[list[int]], max_new_tokens: int, batch_size: int) -> tuple[float, int]:
        """All prompts in batches of ``batch_size``: (wall seconds, new tokens)."""
        assert batch_size >= 1, f"batch_size must be >= 1, got {batch_size}"
        start = time.perf_counter()
        tokens = sum(
            self.generate(prompts[i : i + batch_size], max_new_tokens)
            for i in range(0, len(prompts), batch_size)
        )
        return time.perf_counter() - start, tokens

    def best_batch_size(
        self, prompts: list[list[int]], max_new_tokens: int, candidates: list[int]
    ) -> dict[int, float]:
        """Output tok/s of one batch of each candidate size (after one warm-up), for choosing the best."""
        self.generate(prompts[:1], 2)  # first-call costs (allocations, lazy init) stay out of the timing
        rates = {}
        for bs in sorted({min(c, len(prompts)) for c in candidates}):
            seconds, tokens = self.run(prompts[:bs], max_new_tokens, bs)
            rates[bs] = tokens / seconds
        return rates
