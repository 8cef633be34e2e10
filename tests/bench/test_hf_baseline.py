"""The offline bench's HF baseline loads a GGUF the engine serves from its file (the engine keeps the
file's metadata in its model dir, and no copy of the weights)."""

from __future__ import annotations

from pathlib import Path

from bench.lib.hf_baseline import HFGenerate
from gpu_worker.weights.model_files import embedded_gguf_path, resolve_model


def test_a_gguf_baseline_is_the_dequantized_checkpoint(smollm2_dir: Path) -> None:
    from_file = HFGenerate(resolve_model(None), "float32", gguf=embedded_gguf_path())
    from_dir = HFGenerate(smollm2_dir, "float32")
    prompt = [[1, 504, 3458, 282, 4649, 314]]  # a few ids of SmolLM2's vocabulary
    ids, mask = from_file._batch(prompt)
    outputs = [
        hf.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        for hf in (from_file, from_dir)
    ]
    assert outputs[0].tolist() == outputs[1].tolist()
    assert from_file.generate(prompt, 3) == 3
